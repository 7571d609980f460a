"""Parameter binder of the streaming executor: which parameters stream, where ``param.data`` points, and back.

Owns the host store build (streamed vs resident parameters: `streamed_parameters`, `RESIDENT_TRAINABLE_FRACTION`,
from `lazytrain_hf.planner.layouts` and re-exported here, the split the planner counts), the device slot pools,
binding a layer's parameters to its slot and releasing it, the `ParamPacker` references of saved weights, the
`RecomputeWeights` binding of a checkpointed block, and `remove()`'s restoration. State it owns on the handle:
``_layers``, ``_all``, ``_streamed_ids``, ``_resident``, ``_buffers``, ``_buffer_bytes``, ``_resident_ptrs``.
It does not decide when a fetch is issued (`scheduler.py`) and never touches gradients (`gradients.py`).

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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn as nn

from ..planner.layouts import RESIDENT_TRAINABLE_FRACTION, hf_root, streamed_parameters  # noqa: F401 (re-exported)
from ..streams import set_param_data
from .engine import Slot
from .store import ALIGN_BYTES, LayerStore, align_up


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


@dataclass
class LayerState:
    """Runtime state of one decoder layer (static part, then per-step part); the binder builds it, the completion
    tracker, the gradient path and the extra units (`units.py`) read and update it."""

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
    # Note: [A parameter may have several gradient accumulators] in completion.py: param id -> {node id: the
    # AccumulateGrad node} found in this step's graph, and how many of them have fired
    acc_nodes: dict[int, dict[int, object]] = field(default_factory=dict)
    acc_hits: dict[int, int] = field(default_factory=dict)
    completed: bool = False
    # (the nodes hold their parameter: forgotten when the step's backward ends, `forget_accumulators`)
    device_grad_bytes: int = 0

    def reset_step(self) -> None:
        self.want_bwd = self.in_engine = self.input_rg = self.input_done = self.bwd_started = False
        self.expected = None
        self.accumulated = set()
        self.forget_accumulators()

    def forget_accumulators(self) -> None:
        """Drop the step's accumulator nodes: each holds its parameter, which `torch.utils.swap_tensors` (the
        parameters left on disk by `remove()`) and the garbage collector need released once backward is over."""
        self.acc_nodes = {}
        self.acc_hits = {}
        self.completed = False
        self.device_grad_bytes = 0


class ParameterBinder:
    """`StreamHandle`'s parameter binding (see the module docstring)."""

    def _install_store(self, model: nn.Module, layers: list[nn.Module]) -> None:
        """Build the host store and the slot pools and point every parameter where it lives (phases 1-3 of
        `attach`): streamed parameters at their host compute copy, resident ones (and buffers) on the device."""
        plan, device = self.plan, self.device
        # ---- phase 1: split parameters into streamed (host store) and resident (device) ----
        self._layers: list[LayerState] = []
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
            streamed = streamed_parameters(params)
            keep_train_resident = bool(trainable) and len(streamed) < len(params)
            ls = None
            if streamed:
                ls = self.store.add_layer(
                    i,
                    lp.kind,
                    [(self._names[id(p)], p) for p in streamed],
                    resident_trainable=[self._names[id(p)] for p in trainable] if keep_train_resident else [],
                    compute_dtype=self.compute_dtype,
                )
                streamed_ids.update(id(p) for p in streamed)
            self._layers.append(LayerState(i, layer, lp.kind, ls, bool(lp.resident), {id(p): p for p in trainable}))
        self._all: dict[int, LayerState] = {st.index: st for st in self._layers}
        self._units: dict[int, LayerState] = {}
        self._init_units(streamed_ids)  # Note: [Streamed embeddings and head] (units.py)
        self._streamed_ids = streamed_ids

        # ---- phase 2: slot pool per kind, dedicated slots for plan-resident layers ----
        by_kind: dict[str, list[LayerState]] = {}
        for st in self._layers:
            if st.store is not None and not st.resident:
                by_kind.setdefault(st.kind, []).append(st)
        for kind, sts in by_kind.items():
            nbytes = align_up(max(st.store.nbytes for st in sts), ALIGN_BYTES)
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
                    st.slot = self.engine.dedicated_slot(st.kind, align_up(st.store.nbytes))
                    self.engine.copy_in(st.slot, st.store.compute_bytes, st.index)
                    self._bind(st.index)
            self._resident: list[tuple[str, nn.Parameter, torch.device]] = []
            # Note: [A bf16 compute copy of an fp32 model]: the fp32 values of resident parameters cast to the
            # compute dtype; the optimizer keeps them as its masters (`resident_fp32`) and `remove()` puts them back
            self.resident_fp32: dict[str, torch.Tensor] = {}
            for n, p in model.named_parameters():
                if id(p) in streamed_ids:
                    continue
                self._resident.append((n, p, p.device))
                cast = self.compute_dtype is not None and p.dtype == torch.float32
                if cast:
                    self.resident_fp32[n] = p.data.detach().to("cpu")  # the original tensor on the CPU
                if p.device != device or cast:
                    p.data = p.data.to(device, self.compute_dtype if cast else p.dtype)
                    if p.grad is not None:
                        p.grad = None
            self._buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
            for mod in model.modules():
                for bn, b in list(mod._buffers.items()):
                    if b is not None and b.device != device:
                        self._buffers.append((mod, bn, b))
                        mod._buffers[bn] = b.to(device)
        self._buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        self._resident_ptrs = {p.untyped_storage().data_ptr() for _, p, _ in self._resident}

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

    def _bind(self, i: int) -> None:
        st = self._all[i]
        if st.store is None or st.bound:
            return
        if st.slot is None:
            self._fetch(i, urgent=True)
        self.engine.wait_ready(st.slot)  # Note: [Compute waits for the H2D event]
        buf = st.slot.buffer
        sim = self.engine.simulated
        for e in st.store.entries:  # Note: [Parameters point at the host copy unless bound]
            # Note: [Moving a parameter's data drops its gradient accumulator] in lazytrain_hf/streams.py
            set_param_data(e.param, e.view_bytes(buf), sim)
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
            sim = self.engine.simulated
            for e in st.store.entries:
                set_param_data(e.param, st.store.compute_views[e.name], sim)  # Note: [Moving a parameter's data ...]
            st.bound = False
        self.engine.release(st.slot)  # Note: [Slot reuse waits for the compute event]
        st.slot = None
        self._retry_deferred()

    def resident_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Trainable parameters kept on the device (embeddings, final norm, lm_head, small adapters), by name."""
        return [(n, p) for n, p, _ in self._resident if p.requires_grad]

    def _resident_bytes(self) -> int:
        n = 0
        n = self._buffer_bytes
        for _, p, _ in self._resident:
            n += p.numel() * p.element_size()
            if p.grad is not None:
                n += p.grad.numel() * p.grad.element_size()
        return n

    def _restore_parameters(self) -> None:
        """`remove()`: every parameter back on its original device with its current value, buffers back.

        Note: [Parameters given back share the node copy]
            In a data-parallel run every rank gets the whole trained model back, and a copy of each streamed
            parameter per rank would make every rank hold the whole model in its own memory at the end of `train()`
            (N copies per node, on top of the store still alive). A streamed parameter whose value is its compute
            copy (the compute dtype is its own, its original device the CPU; with fp32 that is its master: Note:
            [Compute copy aliases the fp32 master] in store.py) is instead given a view of the same bytes in the
            rank's copy-on-write mapping of the node's segment (`NodeCopy.private_view`): the node's one copy, read
            by every rank, until a rank writes a parameter, which then gets a page of its own. The mapping outlives
            the node copy's `close` and goes with the last parameter viewing it. The node copy holds the final
            values by then: every rank waited for the last updates of the units it does not own (`gather_masters`
            calls the updater's ``wait_all``). Test: tests/test_trainer_ddp.py, each rank's partition.
        """
        spill = getattr(self, "nvme_state", None)
        node = self.store.node_copy
        with torch.no_grad():
            for st in self._all.values():
                if st.store is None:
                    continue
                if spill is not None and st.index in spill.units:
                    # Note: [Units on NVMe after remove()] in streaming/nvmestate.py
                    spill.leave_on_disk(st.index, st.store)
                    st.slot = None
                    st.bound = False
                    continue
                frozen = st.store.frozen_values()  # Note: [A frozen parameter keeps its own values] in store.py
                for e in st.store.entries:
                    src = st.store.compute_views[e.name]
                    if e.orig_dtype is not None and e.trainable:
                        src = st.store.master_views[e.name]  # Note: [A bf16 compute copy of an fp32 model]
                    elif e.name in frozen:
                        src = frozen[e.name]
                    shared = None
                    if node is not None and e.orig_dtype is None and e.orig_device.type == "cpu":
                        shared = node.private_view(src)  # Note: [Parameters given back share the node copy]
                    elif st.store.masters_shared and e.trainable and e.orig_device.type == "cpu":
                        shared = src  # Note: [Masters live in the node's segment] (training/dataparallel.py)
                    elif node is None and e.name not in frozen and self._own_buffer(src, e):
                        shared = src  # Note: [One process gives its store's buffers back]
                    if shared is not None:
                        e.param.data = shared
                    else:
                        e.param.data = src.to(e.orig_device, e.orig_dtype or e.dtype, copy=e.name not in frozen)
                    e.param.grad = None
                st.slot = None
                st.bound = False
            for n, p, dev in self._resident:
                if n in self.resident_fp32:
                    p.data = self.resident_fp32[n].to(dev)
                    p.grad = None
                elif p.device != dev:
                    p.data = p.data.to(dev)
                    if p.grad is not None:
                        p.grad = p.grad.to(dev)
            for mod, bn, orig in self._buffers:
                orig.copy_(mod._buffers[bn].to(orig.device))
                mod._buffers[bn] = orig

    def _own_buffer(self, src: torch.Tensor, e) -> bool:
        """Whether `remove()` may give parameter ``e`` the store's ``src`` itself instead of a copy.

        Note: [One process gives its store's buffers back]
            Without a node copy (one process) `remove()` used to copy every streamed parameter out of its host
            store and then free the store: for a moment the whole model twice, and the process's peak at the end
            of `train()`. A parameter whose value is ``src`` in its own dtype on its original device, the CPU (the
            compute copy in the parameter's dtype, which with fp32 is its master: Note: [Compute copy aliases the
            fp32 master] in store.py; or the fp32 master of a bf16 compute copy), is instead given ``src``, a view
            of its layer's own buffer: the buffer lives as long as a parameter views it, and the layer's other
            buffers (gradient accumulators, moments) go with the store. Nothing writes the store after `remove()`:
            the updater is closed (its updates landed) before it; a later `attach` copies the values into a new
            store. Not when ``src`` is carved from the store's arena (`HostStore.reserve`: one block for every
            layer's compute copy *and* accumulators, which a view would keep alive whole), nor for a frozen
            parameter with values of its own (Note: [A frozen parameter keeps its own values]). A page-locked
            buffer is unregistered with its layer and stays valid as pageable memory (Note: [Unregister before
            free] in lazytrain_hf/pinned.py). Test: tests/test_given_back.py
            (``test_one_process_gives_the_store_buffers_back``).
        """
        if e.orig_device.type != "cpu" or src.device.type != "cpu" or src.dtype != (e.orig_dtype or e.dtype):
            return False
        if not src.is_contiguous() or tuple(src.shape) != tuple(e.shape):
            return False
        arena = self.store.arena
        return arena is None or src.untyped_storage().data_ptr() != arena.block.untyped_storage().data_ptr()
