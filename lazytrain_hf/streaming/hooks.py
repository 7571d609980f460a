"""Attach the layer-streaming executor to an unmodified HF model through module, autograd and gradient hooks.

`attach(model, plan, device)` moves every decoder layer's parameters into the host store (`store.py`), installs

- a forward pre-hook and a forward hook on every decoder layer: start of stage ``F i`` (issue the transfers the
  plan lists for it, wait for the layer's slot, bind its parameters as views into the slot, enter the activation
  engine's saved-tensor hooks) and its end (leave them, release the slot unless the layer is needed again soon);
- two identity autograd functions around each layer in grad mode: one on the layer output, whose backward marks
  the start of stage ``B i`` (re-fetch the layer, issue the plan's transfers; under block checkpointing,
  ``plan.checkpoint_every > 1``, the top layer of a block also has the activation engine recompute the whole block,
  binding each of its layers through `StreamHandle.recompute_weights`), and one on the layer input, whose
  backward marks that every gradient flowing through the layer has been computed;
- a post-accumulate-grad hook on every trainable parameter: when all the parameters of a layer that take part in
  this backward have their gradient, the layer's gradients are reduced to a squared norm on the device, moved into
  the host fp32 accumulators and freed, and the layer's slot goes back to the pool;

and returns a `StreamHandle` whose `remove()` restores the model exactly. With ``plan.stream_embeddings`` the input
embedding and the head (final norm + lm_head) are streamed too, see Note: [Streamed embeddings and head].

Note: [Parameters point at the host copy unless bound]
    A streamed parameter keeps its `nn.Parameter` object. While its layer is not bound, ``param.data`` is a view
    of the host compute copy (so shapes, dtypes, ``num_parameters()``, ``state_dict()`` and tied-weight checks keep
    working); while bound, a view into the layer's device slot. Autograd saves weights by reference (see Note:
    [Saved weights are references]), so rebinding between forward and backward is safe.

Note: [Saved weights are references]
    Every tensor autograd saves inside a layer's forward goes through `StreamHandle.pack` (the activation engine's
    ``param_packer``): a tensor whose storage is a device slot becomes a `_SlotRef` (layer, byte offset, dtype,
    size, stride) and is rebuilt by `unpack` on the layer's *current* slot, which backward re-fetched. Weights are
    therefore never held on the device between forward and backward.

Note: [When a layer's backward is complete]
    At the end of a layer's forward the autograd graph between its output and its input boundary is walked once
    to find the trainable parameters that will receive a gradient in this backward (MoE experts that got no
    tokens in a non-fused implementation, or unused parameters, are simply absent). The layer is complete when the
    input boundary's backward ran (every node that reads the layer's weights to produce an input gradient has run)
    and each of those parameters has accumulated. A callback queued on the autograd engine completes anything left
    when backward ends, so a missing gradient can never leave a slot held or a gradient on the device.

Note: [Squared norms of accumulated gradients]
    ``sq_norms[i]`` is the squared L2 norm of layer ``i``'s *accumulated* host gradient, exactly. For the first
    micro-batch since ``zero_grad`` the accumulator equals the device gradient, so the norm is taken on the device
    (fp32) before the copy; for later micro-batches (where ``|a + g|^2 != |a|^2 + |g|^2``) it is taken on the host
    right after the addition (on the worker thread on CUDA), so clipping never needs an extra pass at the end.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .. import models
from ..activations import ActivationEngine
from ..planner.plan import Plan
from .engine import Slot, TransferEngine
from .loss import chunked_causal_lm_loss
from .store import ALIGN_BYTES, HostStore, LayerStore, _align

# A layer that mixes frozen and trainable parameters keeps its trainable ones resident (ordinary `.grad`) when they
# hold less than this share of its elements: adapters such as LoRA (r=16 on a 4096-wide q_proj is ~0.8%). Larger
# trainable parts (e.g. a fully trained MLP beside a frozen attention) are streamed with host gradients.
RESIDENT_TRAINABLE_FRACTION = 0.1

_ATTACHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()

# Key of the input-embedding unit in `HostStore.layers` when the plan streams embeddings (the head unit's key is the
# number of decoder layers): sorted keys give the optimizer's order, embedding first, head last.
EMBED_KEY = -1


class _SlotRef(NamedTuple):
    """A saved tensor that is a view of a streamed weight: rebuilt on the layer's current slot when unpacked."""

    layer: int
    byte_offset: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _KeptRef:
    """A saved tensor whose storage is a resident parameter: kept as is (it lives on the device anyway)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _Boundary(torch.autograd.Function):
    """Identity whose backward calls ``fire``. On a layer output its backward is the start of stage ``B i``; on a
    layer input it means every gradient through the layer has been computed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fire: Callable[[], None]) -> torch.Tensor:
        ctx.fire = fire
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.fire()
        return grad, None


@dataclass
class _LayerState:
    """Runtime state of one decoder layer (static part, then per-step part)."""

    index: int
    module: nn.Module
    kind: str
    store: LayerStore | None
    resident: bool  # plan: weights stay on the device (dedicated slot, bound for good)
    trainable: dict[int, nn.Parameter]  # id -> every trainable parameter of the layer (streamed or resident)
    transient: bool = False  # fetched into a transient slot (embeddings / head units), see `_add_units`
    slot: Slot | None = None  # bound, or fetched and waiting to be bound
    bound: bool = False
    # per step
    want_bwd: bool = False
    in_engine: bool = False
    input_rg: bool = False
    input_done: bool = False
    bwd_started: bool = False
    expected: set[int] | None = None
    accumulated: set[int] = field(default_factory=set)
    completed: bool = False
    device_grad_bytes: int = 0

    def reset_step(self) -> None:
        self.want_bwd = self.in_engine = self.input_rg = self.input_done = self.bwd_started = False
        self.expected = None
        self.accumulated = set()
        self.completed = False
        self.device_grad_bytes = 0


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if not isinstance(device, str | torch.device):
        raise TypeError(f"device={device!r} must be a torch.device, a string like 'cuda:0' or None.")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device={device!r} is not a valid device string ({e}); use 'cpu' or 'cuda:0'.") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available; pass device='cpu' or device=None.")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r}: only 'cpu' and 'cuda' devices are supported.")
    return dev


def hf_root(model: nn.Module) -> nn.Module:
    """The `*ForCausalLM` model under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class StreamHandle:
    """The installed executor. Created by `attach`; `remove()` undoes everything.

    Attributes:
        model: the model as passed to `attach` (a PEFT wrapper stays the wrapper).
        plan: the `Plan` being executed.
        device: the compute device.
        store: the `HostStore` (per-layer flat fp32 master, compute copy and fp32 grad buffers, name-keyed views);
            with ``plan.stream_embeddings`` also the embedding (key ``EMBED_KEY``) and the head (key ``num_layers``),
            see Note: [Streamed embeddings and head].
        engine: the `TransferEngine` (slot pool, copy streams).
        activations: the activation engine (saved tensors per the plan).
        sq_norms: ``{layer: squared norm of its accumulated gradient}`` (0-dim fp32 tensors, on the device or the
            host), see Note: [Squared norms of accumulated gradients].
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        device: torch.device,
        activation_engine: Any | None,
        nvme_dir: str | None,
        pin_memory: bool | None,
    ):
        self.model = model
        self.root = hf_root(model)
        self.spec = models.get_spec(self.root)
        self.plan = plan
        self.device = device
        self.is_cuda = device.type == "cuda"
        pin = self.is_cuda if pin_memory is None else bool(pin_memory)
        self.store = HostStore(pin_memory=pin)
        self.engine = TransferEngine(device)
        self.sq_norms: dict[int, torch.Tensor] = {}
        # an OrderedDict (not a dict) so RemovableHandle can hold a weak reference to it
        self._callbacks: OrderedDict[int, Callable[[int, dict[str, torch.Tensor]], None]] = OrderedDict()
        # Called as fetch_guard(layer) before any fetch of a layer reads its host compute copy and before every
        # forward of a resident layer; the trainer uses it to make both wait for that layer's optimizer update
        # (Note: [Update before fetch] in training/updater.py).
        self.fetch_guard: Callable[[int], None] | None = None
        # Called as resident_guard() when a forward begins: the trainer makes it wait for the update of the
        # parameters that are not streamed (embeddings, final norm, lm_head, adapters), which the forward reads first.
        self.resident_guard: Callable[[], None] | None = None
        # Called as grad_reducer(layer, grads) on a layer's complete device gradients (one tensor per trainable
        # parameter, in a fixed order, zeros where a parameter got none) before their norm is taken and they are
        # offloaded: data parallel all-reduces here, so norms and host accumulators see the reduced gradient.
        self.grad_reducer: Callable[[int, list[torch.Tensor]], None] | None = None
        self._hooks: list[RemovableHandle] = []
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._removed = False
        # step state
        self._step_id = 0
        self._phase = "idle"  # "forward" | "backward" | "idle"
        self._grad_step = False
        self._stage = -1
        self._deferred: list[tuple[str, int]] = []
        self._boundary_nodes: set[Any] = set()
        self._device_grad_bytes = 0
        self._peak = 0
        self._loss_stats: dict[str, int] = {}
        self._embed_began = False  # the embedding's pre-hook began this step (layer 0 must not begin another)
        self._loss_peak = 0

        # ---- phase 0: the activation engine first: its checks (NVMe directory, ...) fail before the model is touched
        if activation_engine is None:
            activation_engine = ActivationEngine(plan, device, nvme_dir=nvme_dir, param_packer=self, pin_memory=pin)
        self.activations = activation_engine

        layers = models.decoder_layers(self.root)
        self.num_layers = len(layers)
        self._schedule = plan.issue_schedule()
        L = self.num_layers
        # stage at which the backward fetch of layer i is issued (or None for resident layers)
        self._bwd_issue = {lp.index: max(0, (2 * L - lp.index) - lp.fetch_bwd_ahead) for lp in plan.layers}

        # ---- phase 1: split parameters into streamed (host store) and resident (device) ----
        self._layers: list[_LayerState] = []
        streamed_ids: set[int] = set()
        for i, (layer, lp) in enumerate(zip(layers, plan.layers)):
            params = list(layer.parameters())
            for p in params:
                if id(p) in streamed_ids:
                    raise ValueError(
                        f"parameter {self._names.get(id(p))} is shared between decoder layers; layers sharing "
                        "weights cannot be streamed independently."
                    )
            trainable = [p for p in params if p.requires_grad]
            frozen = [p for p in params if not p.requires_grad]
            n_train = sum(p.numel() for p in trainable)
            n_all = sum(p.numel() for p in params)
            keep_train_resident = bool(frozen) and bool(trainable) and n_train < RESIDENT_TRAINABLE_FRACTION * n_all
            streamed = frozen if keep_train_resident else params
            ls = None
            if streamed:
                ls = self.store.add_layer(
                    i,
                    lp.kind,
                    [(self._names[id(p)], p) for p in streamed],
                    resident_trainable=[self._names[id(p)] for p in trainable] if keep_train_resident else [],
                )
                streamed_ids.update(id(p) for p in streamed)
            self._layers.append(_LayerState(i, layer, lp.kind, ls, bool(lp.resident), {id(p): p for p in trainable}))
        self._all: dict[int, _LayerState] = {st.index: st for st in self._layers}
        self._units: dict[int, _LayerState] = {}
        # Note: [Streamed embeddings and head]
        self.embed_key, self.head_key = EMBED_KEY, self.num_layers
        self._tied = False
        if plan.stream_embeddings:
            self._add_units(streamed_ids)
        self._streamed_ids = streamed_ids

        # ---- phase 2: slot pool per kind, dedicated slots for plan-resident layers ----
        by_kind: dict[str, list[_LayerState]] = {}
        for st in self._layers:
            if st.store is not None and not st.resident:
                by_kind.setdefault(st.kind, []).append(st)
        for kind, sts in by_kind.items():
            nbytes = _align(max(st.store.nbytes for st in sts), ALIGN_BYTES)
            depth = max(
                max(plan.layers[st.index].fetch_fwd_ahead, plan.layers[st.index].fetch_bwd_ahead) for st in sts
            )
            # Note: [Block recomputation binds its layers one by one]: a checkpointed block is recomputed while its
            # top layer is bound and the backward prefetch holds the next layers' slots; the remaining layers of the
            # block are recomputed double-buffered in at most two more slots (the planner's "recompute double
            # buffer"), or one when a single layer is left
            bwd_depth = max(plan.layers[st.index].fetch_bwd_ahead for st in sts)
            extra = min(2, max(0, plan.checkpoint_every - 1 - bwd_depth))
            self.engine.add_pool(kind, nbytes, min(len(sts), max(1, depth) + 1 + extra))

        # ---- phase 3: point streamed params at the host copy, move resident params and buffers ----
        with torch.no_grad():
            for st in self._all.values():
                if st.store is None:
                    continue
                for e in st.store.entries:
                    e.param.data = st.store.compute_views[e.name]
                    if e.param.grad is not None:
                        e.param.grad = None
                if st.resident:
                    st.slot = self.engine.dedicated_slot(st.kind, _align(st.store.nbytes))
                    self.engine.copy_in(st.slot, st.store.compute_bytes, st.index)
                    self._bind(st.index)
            self._resident: list[tuple[str, nn.Parameter, torch.device]] = []
            for n, p in model.named_parameters():
                if id(p) in streamed_ids:
                    continue
                self._resident.append((n, p, p.device))
                if p.device != device:
                    p.data = p.data.to(device)
                    if p.grad is not None:
                        p.grad = p.grad.to(device)
            self._buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
            for mod in model.modules():
                for bn, b in list(mod._buffers.items()):
                    if b is not None and b.device != device:
                        self._buffers.append((mod, bn, b))
                        mod._buffers[bn] = b.to(device)
        self._buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        self._resident_ptrs = {p.untyped_storage().data_ptr() for _, p, _ in self._resident}

        # ---- phase 4: hooks ----
        for st in self._layers:
            self._hooks.append(st.module.register_forward_pre_hook(self._make_pre_hook(st.index), with_kwargs=True))
            self._hooks.append(
                st.module.register_forward_hook(self._make_post_hook(st.index), with_kwargs=True, always_call=True)
            )
            for p in st.trainable.values():
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(st.index)))
        if plan.stream_embeddings:
            self._install_unit_hooks()
        else:
            self._hooks.append(
                models.embed_tokens(self.root).register_forward_pre_hook(lambda *_: self._wait_resident_params())
            )
        self._account()

    # ================================================================== repr
    def __repr__(self) -> str:
        n_str = sum(1 for st in self._layers if st.store is not None and not st.resident)
        return (
            f"StreamHandle(model_type={self.spec.model_type!r}, device={self.device}, layers={self.num_layers}, "
            f"streamed={n_str}, resident_layers={sum(st.resident for st in self._layers)}, "
            f"pools={ {k: len(v) for k, v in self.engine.pools.items()} }, "
            f"stream_embeddings={bool(self._units)}, activations={type(self.activations).__name__}, "
            f"removed={self._removed})"
        )

    # ================================================================== ParamPacker
    def pack(self, t: torch.Tensor) -> object | None:
        """Reference for a saved tensor that is a view of a streamed weight (or of a resident parameter), else None.

        See Note: [Saved weights are references].
        """
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
        slot = self.engine.by_ptr.get(ptr)
        if slot is not None and slot.owner is not None:
            return _SlotRef(
                slot.owner, t.storage_offset() * t.element_size(), t.dtype, tuple(t.shape), tuple(t.stride())
            )
        if ptr in self._resident_ptrs:
            return _KeptRef(t)
        return None

    def unpack(self, ref: object) -> torch.Tensor:
        """The saved view rebuilt on the layer's current slot (fetched on demand if backward has not yet)."""
        if isinstance(ref, _KeptRef):
            return ref.tensor
        if not isinstance(ref, _SlotRef):
            raise TypeError(f"unpack() got {type(ref).__name__}; expected a reference made by pack().")
        self._bind(ref.layer)
        st = self._all[ref.layer]
        flat = st.slot.typed(ref.dtype)
        return flat.as_strided(ref.size, ref.stride, ref.byte_offset // ref.dtype.itemsize)

    # ================================================================== fetch / bind / release
    def _fetch(self, i: int, urgent: bool) -> bool:
        st = self._all[i]
        if st.store is None or st.slot is not None:
            return True
        if self.fetch_guard is not None:
            self.fetch_guard(i)
        if st.transient:
            slot = self.engine.transient_slot(st.kind, st.store.nbytes)
        else:
            slot = self.engine.acquire(st.kind, urgent)
        if slot is None:
            return False
        self.engine.copy_in(slot, st.store.compute_bytes, i)
        st.slot = slot
        return True

    def _bind(self, i: int) -> None:
        st = self._all[i]
        if st.store is None or st.bound:
            return
        if st.slot is None:
            self._fetch(i, urgent=True)
        self.engine.wait_ready(st.slot)  # Note: [Compute waits for the H2D event]
        buf = st.slot.buffer
        for e in st.store.entries:  # Note: [Parameters point at the host copy unless bound]
            e.param.data = e.view_bytes(buf)
        st.bound = True

    @contextlib.contextmanager
    def recompute_weights(self, layer: int, next_layer: int | None = None) -> Iterator[None]:
        """Bind ``layer``'s weights while the activation engine recomputes it inside a checkpointed block
        (`lazytrain_hf.activations.RecomputeWeights`).

        Note: [Block recomputation binds its layers one by one]
            The layer is fetched (unless its slot already holds it) and bound; the fetch of ``next_layer`` is
            issued meanwhile when a slot is free, so it overlaps this layer's recomputation on CUDA. Afterwards
            the slot is released, unless the backward needs the layer next: its backward stage has started (the
            block's top layer) or its backward fetch was already issued (``want_bwd``). Saved weights are recorded
            as references (Note: [Saved weights are references]), so the backward binds the layer again, on
            whatever slot it gets then. A released slot is only refilled after the recomputation's kernels ran
            (Note: [Slot reuse waits for the compute event]).
        """
        st = self._all[layer]
        self._bind(layer)
        if next_layer is not None:
            self._fetch(next_layer, urgent=False)
        try:
            yield
        finally:
            if not (st.bwd_started or st.want_bwd):
                self._release(layer)

    def _release(self, i: int) -> None:
        st = self._all[i]
        if st.resident or st.slot is None:
            return
        if st.bound:
            for e in st.store.entries:
                e.param.data = st.store.compute_views[e.name]
            st.bound = False
        self.engine.release(st.slot)  # Note: [Slot reuse waits for the compute event]
        st.slot = None
        self._retry_deferred()

    def _retry_deferred(self) -> None:
        pending, self._deferred = self._deferred, []
        for what, i in pending:
            st = self._all[i]
            if what == "fetch_fwd" and (self._phase != "forward" or self._stage >= i):
                continue  # its forward already ran (fetched on demand)
            if what == "fetch_bwd" and (st.completed or st.bwd_started):
                continue
            self._issue(what, i)

    def _issue(self, what: str, i: int) -> None:
        if what == "reload":
            if self._grad_step:
                self.activations.prefetch(i)
            return
        if what == "fetch_bwd":
            if not self._grad_step:
                return
            self._all[i].want_bwd = True
        if not self._fetch(i, urgent=False):
            self._deferred.append((what, i))

    def _run_stages(self, s: int) -> None:
        """Start every stage up to ``s`` not started yet: issue what the plan lists for it."""
        while self._stage < s:
            self._stage += 1
            for what, i in self._schedule.get(self._stage, ()):
                self._issue(what, i)

    # ================================================================== step bookkeeping
    def _wait_resident_params(self) -> None:
        if self.resident_guard is not None:
            self.resident_guard()

    def _begin_step(self) -> None:
        self._wait_resident_params()
        if self._phase != "idle":
            self._abort_step()
        self._step_id += 1
        self._embed_began = False
        self._phase = "forward"
        self._grad_step = torch.is_grad_enabled()
        self._stage = -1
        self._deferred.clear()
        self._boundary_nodes.clear()
        for st in self._all.values():
            st.reset_step()

    def _abort_step(self) -> None:
        """End a step that will get no backward (eval forward, exception, discarded graph)."""
        self._deferred.clear()  # first: releasing a slot below must not issue fetches for a step that is over
        for st in self._all.values():
            if st.in_engine:
                st.in_engine = False
                self.activations.end_layer(st.index)
            if not st.completed:
                self._drop_device_grads(st)
            self._release(st.index)
        self._boundary_nodes.clear()
        self.activations.end_step()
        self._phase = "idle"

    def _drop_device_grads(self, st: _LayerState) -> None:
        if st.store is None:
            return
        for e in st.store.trainable_entries:
            e.param.grad = None
        self._device_grad_bytes -= st.device_grad_bytes
        st.device_grad_bytes = 0

    # ================================================================== embeddings and head
    def _add_units(self, streamed_ids: set[int]) -> None:
        """Put the input embedding and the head (final norm + lm_head) into the host store as two extra units.

        Note: [Streamed embeddings and head]
            With ``plan.stream_embeddings`` the input embedding is the unit ``EMBED_KEY`` (-1) and the final norm
            with the lm_head the unit ``num_layers`` of `HostStore.layers`: fp32 master, compute copy and fp32
            gradient accumulators like a decoder layer, updated by the same layer-wise optimizer (sorted keys: the
            embedding first, the head last) and guarded by the same ``fetch_guard``. They are fetched into
            transient slots (Note: [Transient slots are stream-ordered allocations]) since each is used once or
            twice per step:

            - the embedding is bound by its forward pre-hook (which begins the step) and released by its forward
              hook: the lookup's backward is a scatter-add of the output gradient that does not read the weight,
              so the weight's gradient reaches its post-accumulate-grad hook with the unit released and goes to
              the host accumulator like a layer's (Note: [Squared norms of accumulated gradients]);
            - the head is bound by the final norm's forward pre-hook, which also puts an input boundary on the
              norm's input; it stays bound through the lm_head (plain ``model(...)``) or the chunked loss and is
              released when its backward is complete (every trainable head parameter accumulated and the norm's
              input gradient computed), or right away when no backward goes through it (evaluate, generate);
            - tied embeddings (``lm_head.weight is embed_tokens.weight``): the shared parameter belongs to the
              embedding unit only (one master, one accumulator); the head stage binds that unit again and releases
              it with the head. Autograd sums the two uses' gradients before the parameter's accumulation, so the
              head's part waits on the device until the embedding's backward, exactly as with resident weights.
        """
        root = self.root
        embed, norm, head = models.embed_tokens(root), models.final_norm(root), models.lm_head(root)
        embed_params = list(embed.parameters())
        embed_ids = {id(p) for p in embed_params}
        self._tied = any(id(p) in embed_ids for p in head.parameters())
        head_params = list(norm.parameters()) + [p for p in head.parameters() if id(p) not in embed_ids]
        self._embed_module, self._norm_module, self._head_module = embed, norm, head
        for key, kind, module, params in (
            (self.embed_key, "embed", embed, embed_params),
            (self.head_key, "head", norm, head_params),
        ):
            for p in params:
                if id(p) in streamed_ids:
                    raise ValueError(
                        f"plan.stream_embeddings=True: parameter {self._names.get(id(p))} is shared with a decoder "
                        "layer; set stream_embeddings=False for this model."
                    )
            ls = self.store.add_layer(key, kind, [(self._names[id(p)], p) for p in params]) if params else None
            st = _LayerState(key, module, kind, ls, False, {id(p): p for p in params if p.requires_grad})
            st.transient = True
            self._all[key] = self._units[key] = st
            streamed_ids.update(id(p) for p in params)

    def _install_unit_hooks(self) -> None:
        self._hooks.append(self._embed_module.register_forward_pre_hook(self._embed_pre_forward, with_kwargs=True))
        self._hooks.append(
            self._embed_module.register_forward_hook(self._embed_post_forward, with_kwargs=True, always_call=True)
        )
        self._hooks.append(self._norm_module.register_forward_pre_hook(self._head_pre_forward, with_kwargs=True))
        self._hooks.append(
            self._head_module.register_forward_hook(self._head_post_forward, with_kwargs=True, always_call=True)
        )
        for key, st in self._units.items():
            for p in st.trainable.values():
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(key)))

    def _embed_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._begin_step()
        self._embed_began = True
        st = self._all[self.embed_key]
        self._bind(self.embed_key)
        if self._grad_step and torch.is_grad_enabled() and st.trainable:
            st.expected = set(st.trainable)
        # generate() puts input ids on `model.device`, the first parameter's: the host copy while unbound
        if args and isinstance(args[0], torch.Tensor) and args[0].device != self.device:
            args = (args[0].to(self.device), *args[1:])
        return args, kwargs

    def _embed_post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._account()
        self._release(self.embed_key)

    def _head_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._phase == "idle":
            self._begin_step()
        key = self.head_key
        st = self._all[key]
        self._bind(key)
        if self._tied:
            self._bind(self.embed_key)
        if self._grad_step and torch.is_grad_enabled():
            st.expected = set(st.trainable)
            x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor) and x.requires_grad:
                step = self._step_id
                st.input_rg = True
                x = _Boundary.apply(x, lambda: self._on_input_grad(step, key))
                self._boundary_nodes.add(x.grad_fn)
                if args and isinstance(args[0], torch.Tensor):
                    args = (x, *args[1:])
                else:
                    kwargs = {**kwargs, "hidden_states": x}
        self._account()
        return args, kwargs

    def _head_post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._head_end(output)

    def _head_end(self, output: Any) -> None:
        """The head's forward is over (lm_head or chunked loss): release it unless a backward goes through it."""
        st = self._all[self.head_key]
        needs_bwd = st.expected is not None and isinstance(output, torch.Tensor) and output.requires_grad
        self._account()
        if needs_bwd:
            return
        st.expected = None
        st.completed = True
        self._release(self.head_key)
        if self._tied:
            self._release(self.embed_key)

    # ================================================================== forward hooks
    def _make_pre_hook(self, i: int) -> Callable:
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return self._pre_forward(i, module, args, kwargs)

        return pre_hook

    def _make_post_hook(self, i: int) -> Callable:
        def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            return self._post_forward(i, output)

        return post_hook

    def _pre_forward(self, i: int, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if (i == 0 and not self._embed_began) or self._phase != "forward" or self._stage >= i:
            self._begin_step()
        self._embed_began = False
        self._run_stages(i)
        st = self._all[i]
        if st.resident and st.slot is not None:
            # Note: [Update before fetch]: the optimizer's upload of the previous step rewrites the dedicated slot
            if self.fetch_guard is not None:
                self.fetch_guard(i)
            self.engine.wait_ready(st.slot)  # Note: [Compute waits for the H2D event]
        self._bind(i)
        if self._grad_step and torch.is_grad_enabled():
            step = self._step_id
            if args and isinstance(args[0], torch.Tensor):
                x = args[0]
            else:
                x = kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor) and x.requires_grad:
                st.input_rg = True
                x = _Boundary.apply(x, lambda: self._on_input_grad(step, i))
                self._boundary_nodes.add(x.grad_fn)
                if args and isinstance(args[0], torch.Tensor):
                    args = (x, *args[1:])
                else:
                    kwargs = {**kwargs, "hidden_states": x}
            st.in_engine = True
            self.activations.begin_layer(i, module, args, kwargs)
        return args, kwargs

    def _post_forward(self, i: int, output: Any) -> Any:
        st = self._all[i]
        if st.in_engine:
            st.in_engine = False
            self.activations.end_layer(i, output)
        if output is None:  # the layer's forward raised; the next forward or remove() cleans up
            return None
        # Decoder layers return the hidden states (transformers >= 5) or a tuple starting with them.
        h = output if isinstance(output, torch.Tensor) else output[0] if isinstance(output, tuple) else None
        needs_bwd = False
        if self._grad_step and torch.is_grad_enabled() and isinstance(h, torch.Tensor) and h.requires_grad:
            needs_bwd = True
            st.expected = self._expected_params(h.grad_fn, st)
            step = self._step_id
            h = _Boundary.apply(h, lambda: self._on_backward_stage(step, i))
            self._boundary_nodes.add(h.grad_fn)
            output = h if isinstance(output, torch.Tensor) else (h, *output[1:])
        else:
            st.completed = True
        self._account()
        # Keep the layer bound when its backward fetch would be issued at the very next stage (the last layers
        # with prefetch depth 1): fetching it again right away would only cost a transfer.
        keep = needs_bwd and (st.want_bwd or self._bwd_issue[i] <= i + 1)
        if keep:
            st.want_bwd = True
        else:
            self._release(i)
        if i == self.num_layers - 1:
            self._run_stages(self.num_layers)  # stage H starts
        return output

    def _expected_params(self, root: Any, st: _LayerState) -> set[int]:
        """Ids of the layer's trainable parameters reachable from its output. See Note: [When a layer's backward
        is complete]."""
        if not st.trainable:
            return set()
        found: set[int] = set()
        seen: set[int] = set()
        stack = [root]
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in seen or fn in self._boundary_nodes:
                continue
            seen.add(id(fn))
            var = getattr(fn, "variable", None)
            if var is not None:
                if id(var) in st.trainable:
                    found.add(id(var))
                continue
            stack.extend(nxt for nxt, _ in fn.next_functions)
        return found

    # ================================================================== backward hooks
    def _check_step(self, step: int) -> None:
        if step != self._step_id:
            raise RuntimeError(
                "lazytrain_hf streaming: backward of a forward pass older than the latest one. The executor runs one "
                "forward then its backward (as Trainer does); run backward before the next forward."
            )

    def _on_backward_stage(self, step: int, i: int) -> None:
        self._check_step(step)
        self._enter_backward()
        st = self._all[i]
        st.bwd_started = True
        self._run_stages(2 * self.num_layers - i)
        self._bind(i)
        if self.plan.checkpoint_every > 1:
            # the top layer of a checkpointed block: the block is recomputed now, before its backward
            self.activations.begin_backward(i)
        self._account()

    def _enter_backward(self) -> None:
        if self._phase != "backward":
            self._phase = "backward"
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_input_grad(self, step: int, i: int) -> None:
        self._check_step(step)
        if i in self._units and self._phase == "forward":  # the head's backward runs before any layer's
            self._enter_backward()
        self._all[i].input_done = True
        self._maybe_complete(i)

    def _make_grad_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def grad_hook(p: torch.Tensor) -> None:
            st = self._all[i]
            if i in self._units and self._phase == "forward" and st.expected is not None:
                self._enter_backward()  # the head's gradients arrive before any layer's backward stage
            if self._phase != "backward" or st.completed:
                return  # e.g. torch.autograd.backward on a graph this executor did not record
            st.accumulated.add(id(p))
            if id(p) in self._streamed_ids and p.grad is not None:
                n = p.grad.numel() * p.grad.element_size()
                st.device_grad_bytes += n
                self._device_grad_bytes += n
            self._maybe_complete(i)

        return grad_hook

    def _maybe_complete(self, i: int) -> None:
        st = self._all[i]
        if st.completed or st.expected is None:
            return
        if (st.input_done or not st.input_rg) and st.expected <= st.accumulated:
            self._complete(i)

    def _complete(self, i: int) -> None:
        """Move the layer's gradients to the host, take their norm, free them, release the slot."""
        st = self._all[i]
        st.completed = True
        self._account()  # the layer's device gradients are all there now: the backward high-water mark
        ls = st.store
        if ls is not None and ls.grad is not None:
            fresh = not ls.has_grad
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            if self.grad_reducer is not None:
                # every rank must reduce the same tensors in the same order: a parameter without a gradient here
                # (e.g. an expert no local token reached) takes part with zeros
                for e in ls.trainable_entries:
                    if e.param.grad is None:
                        e.param.grad = torch.zeros_like(e.param)
                self.grad_reducer(i, [e.param.grad for e in ls.trainable_entries])
            for e in ls.trainable_entries:
                g = e.param.grad
                if g is None:
                    if fresh:  # accumulators are not zeroed by zero_grad(); see StreamHandle.zero_grad
                        ls.grad_views[e.name].zero_()
                    continue
                pairs.append((g, ls.grad_views[e.name]))
            if fresh:
                # Note: [Squared norms of accumulated gradients]
                sq = torch.zeros((), dtype=torch.float32, device=self.device)
                for g, _ in pairs:
                    sq = sq + torch.linalg.vector_norm(g, dtype=torch.float32).square()
                self.sq_norms[i] = sq
            ls.has_grad = True
            after = self._after_offload(i, host_norm=not fresh)
            self.engine.offload_grads(pairs, accumulate=not fresh, after=after)
            self._drop_device_grads(st)
        elif self._callbacks:
            self._run_callbacks(i)
        self._release(i)
        if i == self.head_key and self._tied:
            self._release(self.embed_key)  # the lm_head's use of the tied weight is over too

    def _after_offload(self, i: int, host_norm: bool) -> Callable[[], None] | None:
        if not host_norm and not self._callbacks:
            return None

        def after() -> None:
            if host_norm:
                flat = self.store.layers[i].grad
                self.sq_norms[i] = torch.dot(flat, flat)
            self._run_callbacks(i)

        return after

    def _run_callbacks(self, i: int) -> None:
        if not self._callbacks:
            return
        grads = self.layer_grads(i)
        for fn in list(self._callbacks.values()):
            fn(i, grads)

    def _on_backward_end(self) -> None:
        self._deferred.clear()  # first: releasing a slot below must not issue fetches for a step that is over
        for st in self._all.values():
            if st.expected is not None and not st.completed:
                self._complete(st.index)
            self._release(st.index)
        self._boundary_nodes.clear()
        self.activations.end_step()
        self._phase = "idle"
        self._account()

    # ================================================================== memory accounting
    def _resident_bytes(self) -> int:
        n = 0
        n = self._buffer_bytes
        for _, p, _ in self._resident:
            n += p.numel() * p.element_size()
            if p.grad is not None:
                n += p.grad.numel() * p.grad.element_size()
        return n

    def _device_bytes(self) -> int:
        act = self.activations.memory_stats().get("gpu_bytes", 0)
        return self.engine.slot_bytes + self._resident_bytes() + act + self._device_grad_bytes

    def _account(self, extra: int = 0) -> None:
        self._peak = max(self._peak, self._device_bytes() + extra)

    def memory_stats(self) -> dict[str, int]:
        """Device and host memory of the executor, in bytes.

        ``device_peak_bytes`` is the high-water mark since `reset_peak`: on CUDA the allocator's
        ``max_memory_allocated``; on CPU the executor's own accounting (``accounted_peak_bytes``), taken at every
        stage boundary and gradient arrival: allocated slots + resident parameters, their gradients and buffers +
        activations the engine keeps on the device + layer gradients waiting for their copy to the host + the
        chunked loss working set (its logits chunk and the gradients it stores). Transient tensors inside a layer's
        own forward or backward are not in the accounted figure (only a device allocator sees them).
        """
        act = self.activations.memory_stats()
        hb = self.store.host_bytes()
        cur = self._device_bytes()
        self._peak = max(self._peak, cur)
        out = {
            "device_peak_bytes": self._peak,
            "accounted_peak_bytes": self._peak,
            "device_bytes": cur,
            "slot_bytes": self.engine.slot_bytes,
            "resident_bytes": self._resident_bytes(),
            "activation_gpu_bytes": act.get("gpu_bytes", 0),
            "activation_gpu_peak_bytes": act.get("gpu_peak_bytes", 0),
            "activation_cpu_bytes": act.get("cpu_bytes", 0),
            "activation_nvme_bytes": act.get("nvme_bytes", 0),
            "host_master_bytes": hb["master"],
            "host_compute_bytes": hb["compute"],
            "host_grad_bytes": hb["grad"],
            "loss_chunk_peak_bytes": self._loss_peak,
            "fetches": self.engine.fetch_count,
            "fetch_bytes": self.engine.fetch_bytes,
        }
        if self.is_cuda:
            out["device_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            out["device_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
        return out

    def reset_peak(self) -> None:
        """Restart every high-water mark from the current usage."""
        self.activations.reset_peak()
        self._peak = self._device_bytes()
        self._loss_peak = 0
        self.engine.fetch_count = self.engine.fetch_bytes = 0
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    # ================================================================== gradients
    def synchronize(self) -> None:
        """Wait until every gradient copy and host accumulation issued so far has finished."""
        self.engine.synchronize()

    def on_layer_grads_ready(self, fn: Callable[[int, dict[str, torch.Tensor]], None]) -> RemovableHandle:
        """Call ``fn(layer_index, grads)`` each time a layer's gradients of a backward are in place.

        ``grads`` maps the model's parameter names to the layer's accumulated host fp32 gradients (views of the
        store) and, for small trainable parameters kept resident (adapters), to their ``.grad``. On CPU ``fn`` runs
        inline during backward; on CUDA on the executor's worker thread once the copy landed (in completion
        order). Use it to all-reduce per layer or to start per-layer optimizer work.
        """
        if not callable(fn):
            raise TypeError(f"on_layer_grads_ready(fn={fn!r}): fn must be callable as fn(layer_index, grads).")
        h = RemovableHandle(self._callbacks)
        self._callbacks[h.id] = fn
        return h

    def layer_grads(self, i: int) -> dict[str, torch.Tensor]:
        """Gradients of decoder layer ``i`` accumulated since `zero_grad`, keyed by parameter name."""
        st = self._all[i]
        out: dict[str, torch.Tensor] = {}
        if st.store is not None and st.store.has_grad:
            out.update(st.store.grad_views)
        for pid, p in st.trainable.items():
            if pid not in self._streamed_ids and p.grad is not None:
                out[self._names[pid]] = p.grad
        return out

    def grads(self) -> dict[str, torch.Tensor]:
        """Gradients accumulated since `zero_grad`, keyed by the model's parameter names: host fp32 accumulators for
        streamed parameters, ordinary ``.grad`` (on the device) for resident ones. Parameters that received no
        gradient are absent (as ``.grad is None``)."""
        self.synchronize()
        out: dict[str, torch.Tensor] = {}
        for st in self._all.values():
            if st.store is not None and st.store.has_grad:
                out.update(st.store.grad_views)
        for n, p, _ in self._resident:
            if p.grad is not None:
                out[n] = p.grad
        return out

    def resident_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Trainable parameters kept on the device (embeddings, final norm, lm_head, small adapters), by name."""
        return [(n, p) for n, p, _ in self._resident if p.requires_grad]

    def zero_grad(self) -> None:
        """Forget accumulated gradients. Host accumulators are not cleared (a pass over all of host memory); the
        next layer completion overwrites them instead of adding, see `StreamHandle.grads`."""
        self.synchronize()
        for ls in self.store.layers.values():
            ls.has_grad = False
        self.sq_norms.clear()
        for _, p, _ in self._resident:
            p.grad = None

    def grad_sq_norms(self) -> dict[int | str, float]:
        """Squared L2 norms of the accumulated gradients: ``{layer_index: float}`` for every layer with host
        gradients, plus ``"resident"`` for all resident parameters (embeddings, final norm, lm_head, adapters)."""
        self.synchronize()
        out: dict[int | str, float] = {i: float(v) for i, v in sorted(self.sq_norms.items())}
        res = torch.zeros((), dtype=torch.float32, device=self.device)
        for _, p, _ in self._resident:
            if p.grad is not None:
                res = res + torch.linalg.vector_norm(p.grad, dtype=torch.float32).to(res.device).square()
        out["resident"] = float(res)
        return out

    def global_grad_norm(self) -> float:
        """L2 norm of every gradient accumulated since `zero_grad` (streamed and resident)."""
        return math.sqrt(sum(self.grad_sq_norms().values()))

    # ================================================================== optimizer side
    def mark_resident_released(self) -> None:
        """The step's compute is queued: the optimizer's uploads into resident slots may follow it (call on the
        training thread after backward). See Note: [Slot reuse waits for the compute event] in engine.py."""
        for st in self._layers:
            if st.resident and st.slot is not None:
                self.engine.mark_released(st.slot)

    def wait_uploads(self) -> None:
        """Make the compute side wait for the optimizer's uploads into resident slots, so that anything reading the
        model's weights next (a callback, a checkpoint, evaluation) sees the updated values. See Note: [Compute
        waits for the H2D event] in engine.py."""
        for st in self._layers:
            if st.resident and st.slot is not None:
                self.engine.wait_ready(st.slot)

    def sync_compute(self, layer: int | None = None, compute_written: bool = False) -> None:
        """Refresh the compute copy (and the device copy of plan-resident layers) from the fp32 master after the
        optimizer changed it; ``layer=None`` does all layers. ``compute_written``: the optimizer already wrote the
        host compute copy (``out_bf16``, after `TransferEngine.wait_host_reads`); only the resident upload is left.
        """
        idx = list(self.store.layers) if layer is None else [layer]
        for i in idx:
            if i not in self.store.layers:
                raise ValueError(
                    f"sync_compute(layer={i}): layer {i} has no streamed parameters; valid: "
                    f"{sorted(self.store.layers)}."
                )
            ls = self.store.layers[i]
            if not compute_written:
                self.engine.wait_host_reads(i)  # Note: [Host compute copy is not rewritten while a fetch reads it]
                ls.sync()
            st = self._all[i]
            if st.resident:
                self.engine.upload(st.slot, ls.compute_bytes)

    # ================================================================== loss
    def causal_lm_loss(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None, ignore_index: int = -100
    ) -> torch.Tensor:
        """Causal-LM loss of ``inputs`` (with ``labels``) through the base model and the chunked loss.

        Same value and gradients as ``model(**inputs).loss`` (up to fp32 summation order), but the full
        ``B x T x V`` logits never exist: see `chunked_causal_lm_loss`.
        """
        if "labels" not in inputs:
            raise ValueError("causal_lm_loss(inputs=...) needs a 'labels' entry (token ids, ignore_index on pads).")
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        inputs.pop("num_items_in_batch", None)
        root = hf_root(model)
        base_path = self.spec.layers.rsplit(".", 1)[0]
        base = root.get_submodule(base_path)
        inputs.setdefault("use_cache", False)
        out = base(**inputs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        head = root.get_submodule(self.spec.lm_head)
        weight = getattr(head, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"{self.spec.lm_head} has no weight tensor; causal_lm_loss needs a plain linear lm_head.")
        stats: dict[str, int] = {}
        loss = chunked_causal_lm_loss(
            hidden,
            weight,
            labels,
            chunk_tokens=self.plan.loss_chunk_tokens,
            ignore_index=ignore_index,
            num_items_in_batch=num_items_in_batch,
            lm_head_bias=getattr(head, "bias", None),
            stats=stats,
        )
        self._loss_stats = stats
        self._loss_peak = max(self._loss_peak, stats.get("peak_bytes", 0))
        self._account(extra=stats.get("peak_bytes", 0))
        if self._units:
            self._head_end(loss)  # Note: [Streamed embeddings and head]
        return loss

    # ================================================================== teardown
    def remove(self) -> None:
        """Restore the model exactly: same `nn.Parameter` objects with their (current) values on their original
        devices, buffers back, every hook removed. Idempotent."""
        if self._removed:
            return
        self.synchronize()
        if self._phase != "idle":
            self._abort_step()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        with torch.no_grad():
            for st in self._all.values():
                if st.store is None:
                    continue
                for e in st.store.entries:
                    src = st.store.compute_views[e.name]
                    e.param.data = src.to(e.orig_device, copy=True)
                    e.param.grad = None
                st.slot = None
                st.bound = False
            for _, p, dev in self._resident:
                if p.device != dev:
                    p.data = p.data.to(dev)
                    if p.grad is not None:
                        p.grad = p.grad.to(dev)
            for mod, bn, orig in self._buffers:
                orig.copy_(mod._buffers[bn].to(orig.device))
                mod._buffers[bn] = orig
        self.activations.close()
        self.engine.close()
        self.store.layers.clear()
        self.sq_norms.clear()
        self._callbacks.clear()
        self._removed = True
        _ATTACHED.discard(self.model)

    def __enter__(self) -> StreamHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def attach(
    model: nn.Module,
    plan: Plan | None = None,
    device: str | torch.device | None = None,
    *,
    activation_engine: Any | None = None,
    nvme_dir: str | None = None,
    pin_memory: bool | None = None,
) -> StreamHandle:
    """Install the layer-streaming executor on a HF causal-LM model (or a PEFT wrapper of one).

    Args:
        model: a supported ``*ForCausalLM`` model (see `lazytrain_hf.models.supported_model_types`), on the CPU or
            the device, or a PEFT model wrapping one.
        plan: the per-layer plan. ``None``: every layer streamed, prefetch depth 1, every activation kept.
        device: compute device; ``None`` picks the current CUDA device when available, else the CPU.
        activation_engine: an activation engine instance to use instead of the default
            (`lazytrain_hf.activations.ActivationEngine` for the plan's policies).
        nvme_dir: directory for activations the plan offloads to NVMe.
        pin_memory: pin the host store; default: on CUDA only.

    Returns:
        The `StreamHandle`; ``handle.remove()`` restores the model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach(model=...) expects a torch.nn.Module, got {type(model).__name__}.")
    if model in _ATTACHED:
        raise ValueError(
            "attach(model=...): this model already has a streaming executor attached; call handle.remove() first."
        )
    root = hf_root(model)
    models.get_spec(root)  # ValueError listing the supported model types
    # transformers renamed the property (is_gradient_checkpointing warns from 5.x on); read whichever exists.
    ckpt_attr = "is_activation_checkpointing" if hasattr(type(root), "is_activation_checkpointing") else None
    if getattr(root, ckpt_attr or "is_gradient_checkpointing", False):
        raise ValueError(
            "attach(model=...): the model has HF gradient checkpointing enabled, which re-enters the decoder layers "
            "during backward; call model.gradient_checkpointing_disable() and use plan policy 'recompute' instead."
        )
    if any(getattr(m, "_hf_hook", None) is not None for m in root.modules()):
        raise ValueError(
            "attach(model=...): the model is dispatched with accelerate hooks (device_map); load it on "
            "the CPU without device_map instead."
        )
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("attach(model=...): the model has parameters on the meta device; load real weights first.")
    dev = _resolve_device(device)
    kinds = models.layer_kinds(root)
    if plan is None:
        plan = Plan.default(len(kinds), kinds=kinds, prefetch_depth=1)
    elif not isinstance(plan, Plan):
        raise TypeError(f"attach(plan=...) expects a lazytrain_hf Plan or None, got {type(plan).__name__}.")
    plan.validate(num_layers=len(kinds))
    for lp, k in zip(plan.layers, kinds):
        if lp.kind != k:
            raise ValueError(
                f"plan.layers[{lp.index}].kind={lp.kind!r} but the model's layer {lp.index} is {k!r}; the plan was "
                "made for another model. Re-plan for this model (or pass plan=None)."
            )
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise TypeError(f"attach(pin_memory={pin_memory!r}) must be a bool or None.")
    if pin_memory and dev.type != "cuda":
        warnings.warn(
            "attach(pin_memory=True) without a CUDA device: pinned memory needs CUDA; ignored.", stacklevel=2
        )
        pin_memory = False
    handle = StreamHandle(model, plan, dev, activation_engine, nvme_dir, pin_memory)
    _ATTACHED.add(model)
    return handle
