"""The saved-tensor router: every tensor autograd saves inside a decoder layer goes where the layer's plan says.

Owns `ActivationEngine` (the executor's interface: `begin_layer` / `end_layer` around each layer's forward,
`prefetch` at the stages the plan names, `begin_backward`, `end_step`), the pack / unpack hooks, the view
deduplication of one storage's saved views, and the step's entries. Where a tensor's bytes live and move is the
tiers' business (`tiers.py`, `nvme.py`); recomputation is `recompute.py`'s. Knows the plan's per-layer policy and
tier only; never touches weights (the executor's `ParamPacker` owns them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import weakref
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from .. import streams
from ..planner.plan import Plan
from ..units import format_bytes
from .layout import Layout, ParamRef, fingerprint, plain_strided, storage_key, tensors_in
from .nvme import IO_MODES, NvmeTier, SpillDir, check_dir, remove_stale_spill_dirs
from .recompute import RecomputeFrame, Recomputer, Slot
from .tiers import DeviceTier, Entry, HostTier, Tier, TierContext

# Note: [Saved tensors are not written in place while their copy runs]
# An offload copy reads the saved tensor asynchronously (a side stream on CUDA, a lane in the simulated engine): a
# layer that writes a saved tensor in place after saving it (autograd's own version check is off under saved-tensor
# hooks) would race that copy. Models do not (plain autograd refuses it at backward); the synchronous CPU engine still
# serves such a tensor correctly, copying it again when it is saved after the write
# (`test_modified_storage_is_copied_again`).


@runtime_checkable
class ParamPacker(Protocol):
    """Implemented by the streaming executor: weights saved by autograd are stored as references, not tensors."""

    def pack(self, t: torch.Tensor) -> object | None:
        """A small reference if ``t`` is a (view of a) streamed weight living in a device slot, else ``None``."""
        ...

    def unpack(self, ref: object) -> torch.Tensor:
        """The same view (offset, size, stride) rebuilt on the layer's current slot."""
        ...


@runtime_checkable
class RecomputeWeights(Protocol):
    """Implemented by the streaming executor (on the object passed as ``param_packer``): binds a streamed layer's
    weights while the activation engine recomputes it inside a checkpointed block."""

    def recompute_weights(self, layer: int, next_layer: int | None) -> contextlib.AbstractContextManager:
        """Context in which ``layer``'s parameters are bound to the device (fetched if needed); ``next_layer`` is
        the layer recomputed next (its fetch may start meanwhile). On exit the weights are released unless the
        backward needs them next."""
        ...


class Saved:
    """What autograd holds for a kept or offloaded tensor. Its death releases the entry's last reference.

    ``view``: ``(size, stride, storage_offset)`` of a tensor restored as a view of the entry's reloaded storage
    (See Note: [Offloaded storages are copied once]); None for the entry's own tensor.
    """

    __slots__ = ("entry", "engine", "view", "__weakref__")

    def __init__(
        self, entry: Entry, engine: weakref.ReferenceType, view: tuple[tuple, tuple, int] | None = None
    ) -> None:
        self.entry, self.engine, self.view = entry, engine, view
        entry.holders += 1

    def __del__(self) -> None:
        engine = self.engine()
        if engine is not None:
            with contextlib.suppress(Exception):
                engine._drop_holder(self.entry)


class LayerCtx:
    """State of one layer call between `begin_layer` and `end_layer`."""

    __slots__ = ("layer", "tier", "hooks", "params", "shared", "frame", "dedup", "active")

    def __init__(self, layer: int, tier: str, active: bool) -> None:
        self.layer, self.tier, self.active = layer, tier, active
        self.hooks: Any = None
        self.params: set[int] = set()
        self.shared: set[int] = set()
        self.frame: RecomputeFrame | None = None
        # storage ptr -> [(weak storage ref, version, entry, storage offset of the copied region)]
        self.dedup: dict[int, list[tuple[StorageWeakRef, int, Entry, int]]] = {}


class ActivationEngine:
    """Carries out the activation placement of a `Plan`: keep / offload_cpu / offload_nvme / recompute per layer.

    Args:
        plan: the plan; ``plan.layers[i].policy`` and ``plan.layers[i].tier`` are read at every `begin_layer`.
        device: the compute device (``"cpu"`` or a CUDA device).
        nvme_dir: directory for spill files (``activation_nvme_dir``); required when the plan uses the nvme tier.
        param_packer: the executor's `ParamPacker`; weights it recognises are stored as references. When it also
            implements `RecomputeWeights`, block recomputation (``plan.checkpoint_every > 1``) asks it to bind each
            layer's weights; without it the layers' parameters are assumed to be usable as they are.
        pin_memory: pin the host buffer pool; default: pinned exactly when ``device`` is CUDA.
        io_threads: background reader threads of the NVMe tier (writes use one ordered writer).
        nvme_max_inflight_bytes: staging bytes of NVMe writes allowed in flight before a pack waits for the oldest
            write (bounds host memory when the disk is slower than the forward).
        nvme_io: how spill files are written and read: ``"auto"`` (``O_DIRECT`` where the filesystem accepts it,
            else write + fdatasync + ``posix_fadvise(DONTNEED)``), ``"direct"``, ``"fadvise"`` or ``"buffered"``
            (page cache; for comparisons). See Note: [Spilled bytes leave RAM] in nvme.py; `spill_io` says what was
            chosen and why.

    Usage (what the executor does)::

        engine = ActivationEngine(plan, device, nvme_dir="/scratch")
        with engine.step():                      # end_step() in finally: files removed even on errors
            loss = model(**batch).loss           # pre-hook: engine.begin_layer(i, ...); post-hook: end_layer(i)
            loss.backward()                      # engine.prefetch(i) at the stages plan.issue_schedule() names,
                                                 # engine.begin_backward(i) when stage B i starts
        engine.memory_stats()
    """

    def __init__(
        self,
        plan: Plan,
        device: torch.device | str,
        nvme_dir: str | None = None,
        param_packer: ParamPacker | None = None,
        pin_memory: bool | None = None,
        io_threads: int = 2,
        nvme_max_inflight_bytes: int = 1 << 30,
        nvme_io: str = "auto",
    ) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(
                f"plan must be a lazytrain_hf Plan, got {type(plan).__name__}; build one with Plan.default."
            )
        plan.validate()
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device={device!r} is not a torch device; pass 'cpu' or 'cuda:0'.") from e
        if device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"device={str(device)!r} is not supported; the activation engine runs on 'cpu' or 'cuda'."
            )
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={str(device)!r} but CUDA is not available; pass device='cpu'.")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        if pin_memory is None:
            pin_memory = streams.pin_host_memory(device)
        if pin_memory and not (torch.cuda.is_available() or streams.simulate_async()):
            raise ValueError("pin_memory=True needs CUDA (page-locked memory); pass pin_memory=None or False on CPU.")
        if param_packer is not None and not isinstance(param_packer, ParamPacker):
            raise TypeError(
                f"param_packer={type(param_packer).__name__} does not implement pack(t) and unpack(ref); "
                "pass an object with both methods or None."
            )
        if io_threads < 1:
            raise ValueError(f"io_threads={io_threads} must be >= 1.")
        if nvme_max_inflight_bytes < 1:
            raise ValueError(f"nvme_max_inflight_bytes={nvme_max_inflight_bytes} must be >= 1.")
        if nvme_io not in IO_MODES:
            raise ValueError(
                f"nvme_io={nvme_io!r} is not one of {IO_MODES}; pass 'auto' (O_DIRECT where the filesystem allows it)."
            )
        nvme_layers = [lp.index for lp in plan.layers if lp.tier == "nvme"]
        if nvme_dir is None and nvme_layers:
            raise ValueError(
                f"the plan puts layers {nvme_layers} on the nvme tier but activation_nvme_dir=None; pass a directory "
                "on a fast local disk (e.g. activation_nvme_dir='/scratch') or plan without offload_nvme."
            )
        if nvme_dir is not None:
            nvme_dir = os.fspath(nvme_dir)
            check_dir(nvme_dir)
            remove_stale_spill_dirs(nvme_dir)

        self.plan = plan
        self.device = device
        self.nvme_dir = nvme_dir
        self.param_packer = param_packer
        self.pin_memory = bool(pin_memory)
        self.nvme_max_inflight_bytes = int(nvme_max_inflight_bytes)
        self._weights = param_packer if isinstance(param_packer, RecomputeWeights) else None
        # the tiers (tiers.py, nvme.py) share the lanes: None for synchronous CPU copies, else CUDA streams or the
        # simulated asynchronous lanes (lazytrain_hf.streams)
        lanes = streams.lanes_for(device, ("d2h", "h2d"), "activations")
        self._tiers = TierContext(device, lanes, self.pin_memory)
        self.pool = self._tiers.pool
        self._acct = self._tiers.acct
        self._nvme = (
            NvmeTier(self._tiers, nvme_dir, io_threads, nvme_max_inflight_bytes, nvme_io)
            if nvme_dir is not None
            else None
        )
        self._tier: dict[str, Tier] = {"gpu": DeviceTier(self._tiers), "cpu": HostTier(self._tiers)}
        if self._nvme is not None:
            self._tier["nvme"] = self._nvme
        # See Note: [Spill files never outlive the process]
        self._finalizer = weakref.finalize(self, SpillDir.cleanup, self._nvme.spill) if self._nvme else None
        self._recompute = Recomputer(self)
        self._self_ref = weakref.ref(self)
        self._stack: list[LayerCtx] = []
        self._entries: dict[int, list[Entry]] = {}  # layer -> entries of the current step
        self._closed = False

    # ------------------------------------------------------------------ checks
    def wait_offloaded(self, layer: int) -> None:
        """The compute side waits until every offload copy of ``layer``'s saved tensors left the device (Note: [Two
        stages of copies in flight] in streaming/engine.py); a no-op when nothing of it is in flight."""
        ev = self._tiers.offload_events.pop(layer, None)
        if ev is not None and self._tiers.lanes is not None:
            self._tiers.lanes.compute_wait(ev)
            self._tiers.bound_host_lead(layer, ev)  # Note: [The host leads the device by two stages] (tiers.py)

    def set_trace(self, trace: Any) -> None:
        """Record every copy and disk transfer in the executor's `Trace` (lazytrain_hf.streaming.trace)."""
        self._tiers.trace = trace

    def check_nvme_capacity(self, bytes_needed: int) -> None:
        """Raise ValueError unless the spill directory exists, is writable and has ``bytes_needed`` bytes free."""
        if self.nvme_dir is None:
            raise ValueError(
                f"the NVMe tier needs {bytes_needed} bytes ({format_bytes(bytes_needed)}) but activation_nvme_dir=None; "
                "pass a directory on a fast local disk."
            )
        if isinstance(bytes_needed, bool) or not isinstance(bytes_needed, int) or bytes_needed < 0:
            raise ValueError(f"bytes_needed={bytes_needed!r} must be a non-negative int number of bytes.")
        check_dir(self.nvme_dir)
        free = shutil.disk_usage(self.nvme_dir).free
        if free < bytes_needed:
            raise ValueError(
                f"activation_nvme_dir={self.nvme_dir!r} has {free} bytes ({format_bytes(free)}) free but the plan "
                f"spills {bytes_needed} bytes ({format_bytes(bytes_needed)}) of activations there per step; free "
                "space, point activation_nvme_dir at a larger disk, or plan fewer layers with offload_nvme."
            )

    @property
    def spill_dir(self) -> str | None:
        """This engine's private spill subdirectory (created on first use), or None."""
        return self._nvme.spill.path if self._nvme is not None else None

    def spill_io(self) -> dict[str, str] | None:
        """How the spill files are written and read: ``{"mode": "direct" | "fadvise" | "buffered", "reason": ...}``
        (the spill directory is made, and the mode probed, here if it was not yet); None without an nvme_dir."""
        if self._nvme is None:
            return None
        self._nvme.spill.ensure()
        return {"mode": self._nvme.spill.io_mode, "reason": self._nvme.spill.io_reason}

    def spill_files(self) -> list[str]:
        """Names of the spill files that exist now (empty between steps)."""
        return self._nvme.spill.file_names() if self._nvme is not None else []

    # ------------------------------------------------------------------ layer hooks
    def begin_layer(self, layer: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Enter the saved-tensor hooks of decoder layer ``layer`` for the duration of its forward.

        Called from the forward pre-hook, after the layer's weights are bound; `end_layer` must follow (also when
        the forward raises: register the post-hook with ``always_call=True``).
        """
        if self._closed:
            raise RuntimeError("ActivationEngine.begin_layer called after close(); create a new engine.")
        if not 0 <= layer < self.plan.num_layers:
            raise ValueError(f"layer={layer} is out of range for a plan of {self.plan.num_layers} layers.")
        self._raise_write_failure()
        lp = self.plan.layers[layer]
        active = torch.is_grad_enabled()
        if active and module.training and getattr(module, "gradient_checkpointing", False):
            raise ValueError(
                f"decoder layer {layer} has HF gradient_checkpointing=True; the plan's recompute policy replaces it. "
                "Call model.gradient_checkpointing_disable() (or TrainingArguments(gradient_checkpointing=False))."
            )
        ctx = LayerCtx(layer, lp.tier, active)
        if active:
            ctx.params = {storage_key(p) for p in module.parameters()} | {storage_key(b) for b in module.buffers()}
            shared = tensors_in(args[1:], []) + tensors_in(
                {k: v for k, v in kwargs.items() if k != "hidden_states"}, []
            )
            ctx.shared = {storage_key(t) for t in shared if plain_strided(t)}
            if self.plan.checkpoint_every > 1:  # validate(): every layer is "recompute" on the gpu tier
                ctx.frame = self._recompute.block_frame(layer, module, args, kwargs, ctx.shared)
            elif lp.policy == "recompute":
                ctx.frame = self._recompute.new_frame(layer, module, args, kwargs, lp.tier, ctx.shared)
            engine = self

            def pack(t: torch.Tensor) -> Any:
                return engine._pack(ctx, t)

            def unpack(obj: Any) -> Any:
                return engine._unpack(obj)

            ctx.hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
            ctx.hooks.__enter__()
        self._stack.append(ctx)

    def end_layer(self, layer: int, output: Any = None) -> None:
        """Exit the saved-tensor hooks of ``layer`` (forward post-hook).

        ``output``: what the layer returned. Block checkpointing needs it: the next layer continues the block only
        when its input is this output (otherwise that layer starts a block of its own).
        """
        if not self._stack or self._stack[-1].layer != layer:
            open_ = [c.layer for c in self._stack]
            raise RuntimeError(f"end_layer({layer}) does not match the open layers {open_}; call begin/end in pairs.")
        ctx = self._stack.pop()
        if ctx.hooks is not None:
            ctx.hooks.__exit__(None, None, None)
        if ctx.frame is not None and ctx.frame.block is not None:
            out = output[0] if isinstance(output, tuple | list) and output else output
            ctx.frame.block.last_out = fingerprint(out) if isinstance(out, torch.Tensor) else None
        ctx.dedup.clear()
        if self._nvme is not None:
            self._nvme.spill.seal(self._nvme.step, layer)
        self._tiers.poll_inflight()
        self._raise_write_failure()

    # ------------------------------------------------------------------ pack
    def _pack(self, ctx: LayerCtx, t: torch.Tensor) -> Any:
        # A recomputed layer stores nothing but the index of each saved tensor, weights included, so the
        # recomputation (which records every saved tensor) serves the same sequence.
        if ctx.frame is not None:
            frame = ctx.frame
            frame.meta.append((t.shape, t.dtype))
            return Slot(frame, len(frame.meta) - 1, self._self_ref)
        # Note: [Weights are never offloaded]
        # Weights come back from the executor's slot (packer) or are kept by reference; they are neither copied nor
        # counted as activations. Shared inputs (rotary cos/sin, masks) are alive anyway: also by reference.
        if self.param_packer is not None:
            ref = self.param_packer.pack(t)
            if ref is not None:
                return ParamRef(ref)
        if not plain_strided(t) or t.device != self.device or t.numel() == 0:
            return t
        key = storage_key(t)
        if key in ctx.params or key in ctx.shared:
            return t
        if ctx.tier == "gpu":
            return Saved(self._keep_entry(ctx.layer, t), self._self_ref)
        # Note: [Offloaded storages are copied once]
        # Several saved tensors often share one storage: an RMSNorm saves its input twice, q/k/v projections each save
        # their own 2-D view of the same normed input, o_proj saves a 2-D view of the attention output that sdpa also
        # saved as 4-D. A saved view whose elements lie inside the dense region an earlier entry of this layer copied
        # from the same storage is restored as a view of that entry's reloaded storage instead of copied again. The
        # match is only trusted while the storage is alive (a weak storage reference: its address cannot have been
        # reused) and unmodified (the version counter views share).
        lo = t.storage_offset()
        hi = lo + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        version = t._version
        cands = ctx.dedup.setdefault(key, [])
        for sref, ver, entry, off0 in cands:
            lay = entry.layout
            if entry.released or ver != version or lay.dtype != t.dtype or sref.expired():
                continue
            if lay.dense and off0 <= lo and hi < off0 + lay.span:
                same = lo == off0 and lay.size == tuple(t.shape) and lay.stride == tuple(t.stride())
                view = None if same else (tuple(t.shape), tuple(t.stride()), lay.pad + lo - off0)
                return Saved(entry, self._self_ref, view)
            if lo == off0 and lay.size == tuple(t.shape) and lay.stride == tuple(t.stride()):
                return Saved(entry, self._self_ref)
        t = t.detach()  # the copies below must not record autograd history
        layout = Layout.of(t)
        view = None
        if layout is None or not layout.dense:
            # Gapped or overlapping views of a storage they mostly cover (the gate / up halves of a chunked
            # projection) copy the whole storage once: later views of it are then served from the same copy and the
            # restored storage is exactly the original one (sizes, strides and offsets).
            itemsize = t.element_size()
            nbytes = t.untyped_storage().nbytes()
            elems = nbytes // itemsize
            if nbytes % itemsize == 0 and elems <= 2 * max(t.numel(), 1):
                view = (tuple(t.shape), tuple(t.stride()), lo)
                t, lo = t.as_strided((elems,), (1,), 0), 0
                layout = Layout.of(t)  # of the whole-storage view now saved
        entry = self._offload_entry(ctx.layer, ctx.tier, t, layout)
        if entry.tier != "gpu":
            cands.append((StorageWeakRef(t.untyped_storage()), version, entry, lo))
        return Saved(entry, self._self_ref, view)

    def _keep_entry(self, layer: int, t: torch.Tensor) -> Entry:
        entry = self._tier["gpu"].store(layer, t, None)
        self._entries.setdefault(layer, []).append(entry)
        return entry

    def _offload_entry(self, layer: int, tier: str, t: torch.Tensor, layout: Layout | None = ...) -> Entry:
        """Hand ``t`` to ``tier``; ``layout`` is `Layout.of(t)` when the caller already has it."""
        if layout is ...:
            layout = Layout.of(t)
        if layout is None:  # overlapping view: see Note: [Saved tensors are restored with their layout]
            return self._keep_entry(layer, t)
        entry = self._tier[tier].store(layer, t, layout)
        self._entries.setdefault(layer, []).append(entry)
        self._tiers.poll_inflight()
        self._raise_write_failure()
        return entry

    def _raise_write_failure(self) -> None:
        if self._nvme is not None:
            self._nvme.raise_write_failure()

    # ------------------------------------------------------------------ reload
    def prefetch(self, layer: int) -> None:
        """Issue the reload of ``layer``'s offloaded tensors (or of its offloaded recompute input) now.

        Called at the stage ``plan.issue_schedule()`` names (``"reload"`` items) so the copy overlaps compute.
        A layer with nothing offloaded (yet) is a no-op; unpacking without a prior prefetch reloads on demand.
        """
        if not 0 <= layer < self.plan.num_layers:
            raise ValueError(f"layer={layer} is out of range for a plan of {self.plan.num_layers} layers.")
        self._raise_write_failure()
        with self._acct.lock:
            entries = [e for e in self._entries.get(layer, ()) if e.tier != "gpu" and not e.released]
        for e in entries:
            self._tier[e.tier].prefetch(e)

    def _materialize(self, entry: Entry) -> torch.Tensor:
        """The device tensor of an entry, reloading on demand and waiting for the reload."""
        return self._tier[entry.tier].materialize(entry)

    # ------------------------------------------------------------------ unpack
    def _unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, Saved):
            out = self._materialize(obj.entry)
            return out if obj.view is None else out.as_strided(*obj.view)
        if isinstance(obj, Slot):
            return self._recompute.unpack_slot(obj)
        if isinstance(obj, ParamRef):
            return self.param_packer.unpack(obj.ref)
        return obj

    def begin_backward(self, layer: int) -> None:
        """Stage ``B layer`` starts (the executor's backward pre-hook, inside backward).

        Under block checkpointing the first backward stage of a block (its top layer) recomputes the whole block
        now, before any of its tensors is unpacked (See Note: [Block recomputation] in recompute.py). A no-op for
        per-layer policies, outside a backward, and for a block already recomputed in this backward.
        """
        self._recompute.begin_backward(layer)

    # ------------------------------------------------------------------ release
    def _drop_holder(self, entry: Entry) -> None:
        with self._acct.lock:
            entry.holders -= 1
            last = entry.holders <= 0
        if last:
            # outside the lock: releasing waits for I/O threads, which take the lock to account bytes
            self._release(entry)

    def _release(self, entry: Entry) -> None:
        """Give back everything an entry holds (device tensors, host buffer, file bytes). Idempotent."""
        self._tier[entry.tier].release(entry)

    # ------------------------------------------------------------------ step
    def synchronize(self) -> None:
        """Wait for every copy and write in flight (benchmarks, memory snapshots)."""
        self._tiers.host_sync("activations: synchronize() waits for every copy and spill write")
        if self._tiers.lanes is not None:
            self._tiers.lanes.synchronize()
        self._tiers.poll_inflight()
        if self._nvme is not None:
            self._nvme.wait_writes()
        self._raise_write_failure()

    def end_step(self) -> None:
        """After backward: drop everything this step stored, delete its spill files; raise a pending write error."""
        self._end_step(raise_errors=True)

    def _end_step(self, raise_errors: bool) -> None:
        while self._stack:  # a forward that raised between begin_layer and end_layer
            ctx = self._stack.pop()
            if ctx.hooks is not None:
                ctx.hooks.__exit__(None, None, None)
        # Note: [The end of a step does not block the host]: pool buffers carry the event of their last copy (Note:
        # [Pool buffers carry their last copy]), released reloads free behind their copy, offload sources are dropped
        # behind theirs (Note: [Offload sources are dropped behind their copy]); only the spill files, removed
        # below, need their reads and writes finished on the host first
        spilled = self._nvme is not None and any(lp.tier == "nvme" for lp in self.plan.layers)
        if spilled and self._tiers.lanes is not None:
            self._tiers.host_sync("activations: end of step waits for the copy lanes before removing spill files")
            self._tiers.lanes.synchronize()
        if self._nvme is not None:
            self._nvme.wait_io()
        self._recompute.release_all()
        for entries in self._entries.values():
            for e in entries:
                self._release(e)
        self._entries.clear()
        self._tiers.drain_inflight()
        self._acct.clear()
        if self._nvme is not None:
            self._nvme.end_step(raise_errors)

    @contextlib.contextmanager
    def step(self) -> Iterator[ActivationEngine]:
        """Context manager around one training step: `end_step` runs in ``finally`` (files removed on errors)."""
        try:
            yield self
        except BaseException:
            self._end_step(raise_errors=False)  # the original error wins over a pending spill error
            raise
        else:
            self._end_step(raise_errors=True)

    def close(self) -> None:
        """Release everything, stop the I/O threads, free the host pool, remove the spill directory. Idempotent."""
        if self._closed:
            return
        self._end_step(raise_errors=False)
        self._closed = True
        if self._tiers.lanes is not None:
            self._tiers.lanes.close()
        self.pool.clear()
        if self._finalizer is not None:
            self._finalizer()  # runs SpillDir.cleanup once and detaches it from exit handling

    def __enter__(self) -> ActivationEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ accounting
    def memory_stats(self) -> dict[str, int]:
        """Bytes of saved activations this engine holds per tier, now and at peak (since `reset_peak`).

        ``gpu``: on the compute device (unique storages; weights, packed references and shared inputs excluded;
        reloaded and recomputed tensors count until autograd has consumed them). ``cpu``: host buffers holding
        offloaded tensors and NVMe staging buffers in flight. ``nvme``: bytes in spill files. ``cpu_pool_bytes``:
        host memory the buffer pool owns (reused across steps).
        """
        self._tiers.poll_inflight()  # offload sources whose copy has landed are no longer device bytes
        with self._acct.lock:
            cur, peak = dict(self._acct.cur), dict(self._acct.peak)
        return {
            "gpu_bytes": cur["gpu"],
            "gpu_peak_bytes": peak["gpu"],
            "cpu_bytes": cur["cpu"],
            "cpu_peak_bytes": peak["cpu"],
            "nvme_bytes": cur["nvme"],
            "nvme_peak_bytes": peak["nvme"],
            "cpu_pool_bytes": self.pool.allocated_bytes,
        }

    def reset_peak(self) -> None:
        self._acct.reset_peak()

    def layer_bytes(self) -> dict[int, dict[str, int]]:
        """Bytes each layer stored per tier since the engine was built (summed over forwards; cleared by
        `reset_layer_bytes`): the measured side of the planner's activation cost model."""
        return {k: dict(v) for k, v in sorted(self._tiers.layer_bytes.items())}

    def reset_layer_bytes(self) -> None:
        self._tiers.layer_bytes.clear()

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for lp in self.plan.layers:
            name = lp.policy + (f"({lp.input_tier})" if lp.policy == "recompute" else "")
            counts[name] = counts.get(name, 0) + 1
        policies = ", ".join(f"{k}={v}" for k, v in counts.items())
        return (
            f"ActivationEngine(device={str(self.device)!r}, layers={self.plan.num_layers} [{policies}], "
            f"checkpoint_every={self.plan.checkpoint_every}, "
            f"nvme_dir={self.nvme_dir!r}, pin_memory={self.pin_memory}, "
            f"packer={type(self.param_packer).__name__ if self.param_packer else None})"
        )
