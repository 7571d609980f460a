"""Attach the layer-streaming executor to an unmodified HF model through module, autograd and gradient hooks.

`attach(model, plan, device)` moves every decoder layer's parameters into the host store (`store.py`), installs

- a forward pre-hook and a forward hook on every decoder layer: start of stage ``F i`` (issue the transfers the
  plan lists for it, wait for the layer's slot, bind its parameters as views into the slot, enter the activation
  engine's saved-tensor hooks) and its end (leave them, release the slot unless the layer is needed again soon);
- two identity autograd functions around each layer in grad mode: one on the layer output, whose backward marks
  the start of stage ``B i`` (re-fetch the layer, issue the plan's transfers; under block checkpointing,
  ``plan.checkpoint_every > 1``, the top layer of a block also has the activation engine recompute the whole block,
  or with ``plan.block_graphs == "layer"`` run its lower layers under ``no_grad`` keeping their outputs, binding
  each of its layers through `StreamHandle.recompute_weights`), and one on the layer input, whose
  backward marks that every gradient flowing through the layer has been computed;
- a post-accumulate-grad hook on every trainable parameter: when all the parameters of a layer that take part in
  this backward have their gradient, the layer's gradients are reduced to a squared norm on the device, moved into
  the host fp32 accumulators and freed, and the layer's slot goes back to the pool;

and returns a `StreamHandle` whose `remove()` restores the model exactly. With ``plan.stream_embeddings`` the input
embedding and the head (final norm + lm_head) are streamed too, see Note: [Streamed embeddings and head].

The handle is assembled from one class per concept: `binder.ParameterBinder` (store build, binding, `remove`),
`scheduler.FetchScheduler` (stages, deferred issues, guards, slots), `completion.CompletionTracker` (step phases,
expected vs accumulated gradients), `gradients.GradientSink` (reduce, norm, offload, callbacks) and
`units.HeadUnits` (streamed embeddings and head). This module owns the forward hooks of decoder layers, the
executor's device-memory accounting, the chunked loss entry point and `attach`.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .. import models, streams, threads
from ..activations import ActivationEngine
from ..planner.plan import Plan
from ..streams import pin_host_memory
from .binder import RESIDENT_TRAINABLE_FRACTION, ParameterBinder, hf_root
from .completion import Boundary, CompletionTracker
from .engine import TransferEngine
from .gradients import GradientSink
from .loss import chunked_causal_lm_loss
from .nvmestate import NvmeState
from .scheduler import FetchScheduler
from .store import HostStore, fix_mmap_threshold, has_disk_source
from .units import EMBED_KEY, HeadUnits

__all__ = ["EMBED_KEY", "RESIDENT_TRAINABLE_FRACTION", "StreamHandle", "attach", "hf_root"]

_ATTACHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


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


class StreamHandle(ParameterBinder, FetchScheduler, CompletionTracker, GradientSink, HeadUnits):
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
        compute_dtype: torch.dtype | None = None,
        state_nvme: dict[str, Any] | None = None,
        unit_owners: dict[int, int] | None = None,
        rank: int = 0,
        node_copy: Any = None,
        node_masters: dict[int, torch.Tensor] | None = None,
    ):
        self.model = model
        self.root = hf_root(model)
        self.spec = models.get_spec(self.root)
        self.plan = plan
        self.device = device
        self.compute_dtype = compute_dtype  # Note: [A bf16 compute copy of an fp32 model]
        # why `causal_lm_loss` must run the model's own forward (an adapter outside the layers), or None
        self._full_model_loss = chunked_loss_unsupported(model)
        self.is_cuda = device.type == "cuda"
        pin = pin_host_memory(device) if pin_memory is None else bool(pin_memory)
        self.store = HostStore(pin_memory=pin)
        # Note: [The training state is partitioned by unit] (planner/world.py): the owner rank of each streamed unit's
        # training state (None: this process holds every unit's); this process is ``rank``
        self.unit_owners = dict(unit_owners) if unit_owners is not None else None
        self.rank = int(rank)
        if self.unit_owners is not None:
            self.store.owned = {k for k, r in self.unit_owners.items() if r == self.rank}
            fix_mmap_threshold()  # Note: [A rank's large blocks are mapped] in store.py
        self.store.node_copy = node_copy  # Note: [The node's compute copy is shared by its ranks]
        self.store.node_masters = dict(node_masters or {})  # Note: [Masters live in the node's segment]
        self.engine = TransferEngine(device)
        # every transfer, compute span, update and host synchronisation of a step (lazytrain_hf.streaming.trace)
        self.trace = self.engine.trace
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
        # offloaded. `host_grad_reducer` (Note: [Data parallel reduces the host accumulators once per step] in
        # gradients.py): once per optimizer step, on the host fp32 accumulators of a replicated state.
        self.grad_reducer: Callable[[int, list[torch.Tensor]], None] | None = None
        self.host_grad_reducer: Callable[[int, list[torch.Tensor]], None] | None = None
        # With `unit_owners`: called as owner_grad_reducer(unit, flat, owner, last) on every rank, every micro-batch,
        # on a unit's flat fp32 gradient (the owner's accumulator, another rank's staging): sums it into the owner's
        # (Note: [Partitioned gradients are reduced to their owner every micro-batch] in gradients.py)
        self.owner_grad_reducer: Callable[[int, torch.Tensor, int, bool], None] | None = None
        # With `unit_owners` and the plan's dp_reduce == "device": called as owner_device_reducer(unit, grads, owner)
        # on every rank on a unit's complete device gradients, before any D2H copy (Note: [Gradients reduced on the
        # device skip the other ranks' D2H] in gradients.py); replaces owner_grad_reducer
        self.owner_device_reducer: Callable[[int, list[torch.Tensor], int], None] | None = None
        # whether the micro-batch in progress is the last of its optimizer step (bool or a callable): only then are
        # host norms taken and accumulators reduced (gradients.py); standalone use: every backward is a step
        self.last_micro_batch: bool | Callable[[], bool] = True
        # fetch_ready(layer): may a prefetch read the layer's host compute copy now (its update is done)? A prefetch
        # that may not is deferred; Note: [A prefetch never waits for the optimizer] in scheduler.py
        self.fetch_ready: Callable[[int], bool] | None = None
        self._hooks: list[RemovableHandle] = []
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._removed = False
        # step state
        self._step_id = 0
        self._forward_t0 = time.perf_counter()
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
        self._span_start: dict[tuple[str, int], Any] = {}  # compute spans open in the trace

        # ---- phase 0: the activation engine first: its checks (NVMe directory, ...) fail before the model is touched
        if activation_engine is None:
            # a weak proxy: the engine must not keep the handle alive (a handle <-> engine cycle kept every host
            # store, page-locked on CUDA, until a full garbage collection; Note: [remove() frees the host store])
            activation_engine = ActivationEngine(
                plan, device, nvme_dir=nvme_dir, param_packer=weakref.proxy(self), pin_memory=pin
            )
        self.activations = activation_engine
        # the training state of the units in plan.state_nvme lives on NVMe (lazytrain_hf.streaming.nvmestate)
        self.nvme_state: NvmeState | None = None
        if plan.state_nvme:
            if not state_nvme or not state_nvme.get("dir"):
                raise ValueError(
                    f"plan.state_nvme lists units {plan.state_nvme} but no state_nvme_dir was given; pass "
                    "state_nvme_dir (LazyTrainingArguments) or a plan without state_nvme."
                )
            self.nvme_state = NvmeState(
                state_nvme["dir"],
                self.trace,
                block_size=int(state_nvme.get("block_size", 256)),
                min_8bit_size=int(state_nvme.get("min_8bit_size", 4096)),
                pin_memory=pin,
                simulated=self.engine.simulated,
            )
            wanted = set(plan.state_nvme)
            if self.store.owned is not None:
                wanted &= self.store.owned  # a rank's state files hold its own units only
            self.store.no_grad_buffer = set(wanted)  # their gradients live in their state files
            self.store.on_add = lambda key, ls: self.nvme_state.add_unit(key, ls) if key in wanted else None
        if hasattr(activation_engine, "set_trace"):
            activation_engine.set_trace(self.trace)

        layers = models.decoder_layers(self.root)
        self.num_layers = len(layers)
        self._schedule = plan.issue_schedule()
        # stage at which the backward fetch of layer i is issued (or None for resident layers)
        self._bwd_issue = {lp.index: plan.bwd_issue_stage(lp.index) for lp in plan.layers}

        try:
            self._install_store(model, layers)
        except BaseException:
            if self.nvme_state is not None:
                self.nvme_state.close()
            raise
        self.store.on_add = None
        # Note: [Backward runs on another thread] (a test profile of the simulation)
        self._autograd_thread = self.engine.simulated and threads.simulate_autograd_thread()
        if self._autograd_thread:
            threads.install_autograd_thread()

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
        self.trace.reset()  # the resident slots' first fill belongs to attach, not to a step

    def __repr__(self) -> str:
        n_str = sum(1 for st in self._layers if st.store is not None and not st.resident)
        return (
            f"StreamHandle(model_type={self.spec.model_type!r}, device={self.device}, layers={self.num_layers}, "
            f"streamed={n_str}, resident_layers={sum(st.resident for st in self._layers)}, "
            f"pools={ {k: len(v) for k, v in self.engine.pools.items()} }, "
            f"stream_embeddings={bool(self._units)}, activations={type(self.activations).__name__}, "
            f"removed={self._removed})"
        )

    @property
    def _stage(self) -> int:
        """The stage of the step in progress (``F_i = i``, ``H = L``, ``B_i = 2L - i``); the trace records it."""
        return self.__dict__.get("_stage_value", -1)

    @_stage.setter
    def _stage(self, value: int) -> None:
        self.__dict__["_stage_value"] = value
        self.engine.trace.stage = value

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
        if self._grad_step and i >= 2:
            self.activations.wait_offloaded(i - 2)  # Note: [Two stages of copies in flight] in engine.py
        self._span_start[("forward", i)] = self.trace.mark()  # the weights are there: pure compute from here
        if self._grad_step and torch.is_grad_enabled():
            step = self._step_id
            if args and isinstance(args[0], torch.Tensor):
                x = args[0]
            else:
                x = kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor) and x.requires_grad:
                st.input_rg = True
                x = Boundary.apply(x, lambda: self._on_input_grad(step, i))
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
        start = self._span_start.pop(("forward", i), None)
        if start is not None and output is not None:
            self.trace.span("forward", i, start, self.trace.mark())
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
            h = Boundary.apply(h, lambda: self._on_backward_stage(step, i))
            self._boundary_nodes.add(h.grad_fn)
            output = h if isinstance(output, torch.Tensor) else (h, *output[1:])
        else:
            st.completed = True
        self._account()
        # Keep the layer bound when its backward fetch would be issued at the very next stage (the last layers
        # with prefetch depth 1): fetching it again right away would only cost a transfer.
        keep = needs_bwd and (st.want_bwd or self.plan.keeps_bound_after_forward(i))
        if keep:
            st.want_bwd = True
        else:
            self._release(i)
        if i == self.num_layers - 1:
            if self.engine.simulated:
                # Note: [Every background worker stalls for longer than a forward] in lazytrain_hf/streams.py
                streams.note_forward(time.perf_counter() - self._forward_t0)
            self._run_stages(self.num_layers)  # stage H starts
            if self._grad_step and i >= 1:
                self.activations.wait_offloaded(i - 1)  # Note: [Two stages of copies in flight] in engine.py
        return output

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

    def causal_lm_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        aux_loss_weight: float | None = None,
    ) -> torch.Tensor:
        """Causal-LM loss of ``inputs`` (with ``labels``) through the base model and the chunked loss.

        Same value and gradients as ``model(**inputs).loss`` (up to fp32 summation order), but the full
        ``B x T x V`` logits never exist: see `chunked_causal_lm_loss`. MoE families with ``output_router_logits``
        on add the router auxiliary loss as their ``*ForCausalLM`` does (`models.router_aux_loss`), weighted by
        ``aux_loss_weight`` when given (else the model's ``router_aux_loss_coef``). A PEFT model
        whose adapter acts outside the decoder layers the chunked path calls (prompt tuning's virtual tokens, a LoRA
        on the lm_head; `chunked_loss_unsupported`) is run through its own forward instead, full logits included.
        """
        if "labels" not in inputs:
            raise ValueError("causal_lm_loss(inputs=...) needs a 'labels' entry (token ids, ignore_index on pads).")
        if self._full_model_loss is not None:
            # as Trainer.compute_loss calls it (the loss normalised by num_items_in_batch when given)
            kwargs = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
            out = model(**{k: v for k, v in inputs.items() if k != "num_items_in_batch"}, use_cache=False, **kwargs)
            return out.loss
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        inputs.pop("num_items_in_batch", None)
        root = hf_root(model)
        base_path = self.spec.layers.rsplit(".", 1)[0]
        base = root.get_submodule(base_path)
        inputs.setdefault("use_cache", False)
        router = self.spec.router_aux_loss and bool(
            inputs.pop("output_router_logits", None) or getattr(root.config, "output_router_logits", False)
        )
        if router:
            inputs["output_router_logits"] = True
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
        if router:
            aux = models.router_aux_loss(root, out.router_logits, inputs.get("attention_mask"), coef=aux_loss_weight)
            loss = loss + aux.to(loss.device)
        self._loss_stats = stats
        self._loss_peak = max(self._loss_peak, stats.get("peak_bytes", 0))
        self._account(extra=stats.get("peak_bytes", 0))
        if self._units:
            self._head_end(loss)  # Note: [Streamed embeddings and head]
        return loss

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
        self._restore_parameters()
        if self.nvme_state is not None:
            self.nvme_state.release()
        self.activations.close()
        self.engine.close()
        self.store.layers.clear()
        self.sq_norms.clear()
        self._callbacks.clear()
        # Note: [remove() frees the host store]
        #     Nothing the handle holds may point back at it once removed: the activation engine gets a weak proxy
        #     of it, and the guards a trainer installed (its bound methods; the trainer holds the handle) are
        #     dropped here. The host store (page-locked on CUDA) is then freed when the last reference to the
        #     handle goes, not at the next full garbage collection. Test:
        #     tests/test_cuda_semantics_grad.py::test_remove_leaves_no_reference_cycle.
        self.fetch_guard = self.resident_guard = self.fetch_ready = None
        self.grad_reducer = self.host_grad_reducer = self.owner_grad_reducer = None
        self.release_remote_staging()
        self.last_micro_batch = True
        if self._autograd_thread:
            threads.uninstall_autograd_thread()
        self._removed = True
        _ATTACHED.discard(self.model)

    def __enter__(self) -> StreamHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def chunked_loss_unsupported(model: nn.Module) -> str | None:
    """Why the chunked loss (base model + lm_head weight) would bypass part of ``model``, or None when it applies:
    a PEFT prompt-learning adapter (its virtual tokens are added by `PeftModel.forward`) or an adapter on the
    lm_head (the chunked loss reads ``lm_head.weight`` only)."""
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, dict):
        return None
    for name, cfg in peft_config.items():
        if getattr(cfg, "is_prompt_learning", False):
            return f"adapter {name!r} is {cfg.peft_type} (prompt learning)"
    head = models.lm_head(hf_root(model))
    if any(p.requires_grad for p in head.parameters()) and type(head) is not nn.Linear:
        return f"the lm_head is wrapped by an adapter ({type(head).__name__})"
    return None


def attach(
    model: nn.Module,
    plan: Plan | None = None,
    device: str | torch.device | None = None,
    *,
    activation_engine: Any | None = None,
    nvme_dir: str | None = None,
    pin_memory: bool | None = None,
    compute_dtype: torch.dtype | None = None,
    state_nvme_dir: str | None = None,
    optim_block_size: int = 256,
    optim_min_8bit_size: int = 4096,
    unit_owners: dict[int, int] | None = None,
    rank: int = 0,
    node_copy: Any = None,
    node_masters: dict[int, torch.Tensor] | None = None,
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
        compute_dtype: ``torch.bfloat16`` to compute with a bf16 copy of an fp32 model (``bf16=True``).
        state_nvme_dir: directory for the training state of the units in ``plan.state_nvme``
            (`lazytrain_hf.streaming.nvmestate`), laid out for the optimizer's ``optim_block_size`` and
            ``optim_min_8bit_size``.
        unit_owners / rank: data parallel with the training state partitioned by unit (Note: [The training state is
            partitioned by unit] in planner/world.py): ``{unit key: owner rank}`` and this process's rank; the host
            store holds masters and gradient accumulators (and ``state_nvme_dir`` state files) of owned units only;
            ``node_copy``: a `NodeCopy` the compute copies are carved from (one per node, shared by its ranks);
            ``node_masters``: ``{unit key: fp32 buffer}`` in the node's segment of masters, where an owned unit's
            masters live (Note: [Masters live in the node's segment] in training/dataparallel.py).

            Note: [A bf16 compute copy of an fp32 model]
                Every fp32 parameter is computed in bf16: the host store's compute copy (what slots receive) and
                resident parameters on the device are bf16, the fp32 masters are the parameters' own fp32 values
                (streamed: the store's master; resident: `StreamHandle.resident_fp32`), and `remove()` gives each
                trainable parameter its fp32 master back (a frozen one its own
                original tensor: Note: [A frozen parameter keeps its own values] in store.py). The model then runs
                as a bf16-loaded model does, with fp32 masters for the optimizer.

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
    models.check_causal_lm(root)  # ValueError listing the supported model types / classes
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
    for name, cfg in (getattr(model, "peft_config", None) or {}).items():
        if str(getattr(cfg, "peft_type", "")).endswith("PREFIX_TUNING"):
            raise ValueError(
                f"attach(model=...): PEFT adapter {name!r} is prefix tuning, whose prefix lives in the attention cache "
                "that recomputation does not replay; use LoRA or prompt tuning with streaming, or train it with "
                "stream_enabled=False."
            )
    if any(p.device.type == "meta" and not has_disk_source(p) for p in model.parameters()):
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
    if compute_dtype not in (None, torch.bfloat16):
        raise ValueError(
            f"attach(compute_dtype={compute_dtype!r}): only torch.bfloat16 (or None: each parameter's own dtype) is "
            "supported."
        )
    state_nvme = {"dir": state_nvme_dir, "block_size": optim_block_size, "min_8bit_size": optim_min_8bit_size}
    handle = StreamHandle(
        model,
        plan,
        dev,
        activation_engine,
        nvme_dir,
        pin_memory,
        compute_dtype,
        state_nvme,
        unit_owners,
        rank,
        node_copy,
        node_masters,
    )
    _ATTACHED.add(model)
    return handle
