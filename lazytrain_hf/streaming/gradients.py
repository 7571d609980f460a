"""Gradient sink of the streaming executor: a completed layer's gradients reduced, normed, offloaded and handed on.

Owns what happens to a layer's device gradients once its backward is complete (`_complete`): the data-parallel
``grad_reducer``, the squared norm, the copy into the host fp32 accumulators (`TransferEngine.offload_grads`), the
per-layer callbacks, and the public gradient API (`grads`, `layer_grads`, `zero_grad`, `grad_sq_norms`,
`global_grad_norm`, `synchronize`). State: ``sq_norms``, ``_callbacks``, ``_device_grad_bytes``. It does not decide
when a layer is complete (`completion.py`).

Note: [Squared norms of accumulated gradients]
    ``sq_norms[i]`` is the squared L2 norm of layer ``i``'s *accumulated* host gradient, exactly, taken once per
    optimizer step: only on the last micro-batch of the step (`last_micro_batch`, which the trainer points at its
    gradient state; default True, every backward is the last). For a first micro-batch since ``zero_grad`` that is
    also the last (no gradient accumulation) the accumulator equals the device gradient, so the norm is taken on
    the device (fp32) before the copy; on a last micro-batch that adds into the accumulator (where
    ``|a + g|^2 != |a|^2 + |g|^2``), or when the accumulator is reduced across ranks first (`host_grad_reducer`),
    it is taken on the host right after the addition (on the worker thread on CUDA), so clipping never needs an
    extra pass at the end. Earlier micro-batches take no norm. A norm asked for anyway (`grad_sq_norms` after a
    micro-batch that was not the last) is taken from the host accumulator then. Tests:
    ``tests/test_cuda_path.py::test_one_host_norm_pass_per_layer_and_step`` and the gradient-accumulation cases
    of ``tests/test_feature_matrix.py`` (norms and clipping against Trainer).

Note: [Data parallel reduces the host accumulators once per step]
    With `host_grad_reducer` set (data parallel), a layer's gradient is reduced once per optimizer step: after the
    last micro-batch's gradient was added into the host fp32 accumulator, the reducer gets that flat fp32 buffer
    (``[LayerStore.grad]``) and averages it across ranks in place (the trainer uses a gloo group, so it runs on
    the worker thread on CUDA while the next layers' backward goes on); the norm is then taken of the reduced
    accumulator. Earlier micro-batches accumulate locally, as ``no_sync`` does for DDP. Every rank completes its
    layers in the same order, so the reductions pair up. This is the replicated state (every rank holds every
    accumulator); `LazyTrainer` partitions it instead (Note: [Partitioned gradients are reduced to their owner every
    micro-batch]), ``host_grad_reducer`` stays for a `StreamHandle` used without ``unit_owners``.

Note: [Partitioned gradients are reduced to their owner every micro-batch]
    With the training state partitioned by unit (`StreamHandle.unit_owners`; Note: [The training state is
    partitioned by unit] in planner/world.py) only the owner of a unit has its fp32 accumulator. When the unit's
    backward is complete, the owner adds its device gradient into the accumulator as without data parallel; any
    other rank copies it into a reused fp32 staging buffer (`RemoteGradStaging`: at most
    `REMOTE_STAGING_UNITS` units' gradients, as the gradient staging of `planner.hostmem.GRAD_STAGING_LAYERS`).
    Then every rank calls ``owner_grad_reducer(unit, flat, owner, last)`` on that buffer, which sums the ranks'
    buffers into the owner's accumulator (a reduce, on the executor's worker thread on CUDA, like the all-reduce it
    replaces). A non-owner has nowhere to accumulate a gradient across micro-batches, so with gradient accumulation
    the reduce runs every micro-batch, not once per optimizer step: the owner's accumulator then holds the sum of
    the earlier micro-batches of every rank plus this one's, the others' staging only this micro-batch's gradient
    (DeepSpeed ZeRO-2 reduces every micro-batch for the same reason). The reducer divides by the world size once,
    on the owner, at the last micro-batch; the owner then takes the squared norm of its reduced accumulator (on the
    host, Note: [Squared norms of accumulated gradients]); a non-owner takes none. Every rank completes its units
    in the same order, so the reduces pair up. Each non-owner's reduce is recorded in the trace on the lane ``net``
    as ``reduce`` with the unit's fp32 gradient bytes. This is the plan's ``dp_reduce_every == "micro_batch"``; with
    ``"step"`` a non-owner accumulates instead (Note: [Gradients reduced once per step]). Tests:
    ``tests/test_trainer_ddp.py``.

Note: [Gradients reduced once per step]
    With the plan's ``dp_reduce_every == "step"`` (host path only; `lazytrain_hf.planner.dpreduce` picks it where the
    g-fold fewer ``net`` bytes shorten the step and the accumulators fit the host budget) a rank holds a private fp32
    accumulator for every unit another rank owns (allocated at the unit's first completion, zero-filled, registered
    when the store pins; `planner.hostmem` counts them as ``step_grads``). Every micro-batch, when the unit's backward
    is complete, the rank adds its device gradient into that accumulator exactly as the owner (and a single process)
    adds into its own: copied D2H on the first micro-batch since ``zero_grad``, added through the gradient staging
    after it, a parameter without a gradient zeroed on the first micro-batch and skipped after. Only after the last
    micro-batch's addition (on the worker thread, so it overlaps the next units' backward as the per-micro-batch
    reduce does) every rank calls ``owner_grad_reducer(unit, flat, owner, True)``, the owner on its accumulator and
    the others on theirs: the owner's accumulator becomes the sum over ranks and micro-batches, divided by the world
    size, its norm is taken after it. The ``net`` lane carries ``1/g`` of the per-micro-batch mode's bytes (a
    ``reduce`` of the unit's fp32 bytes once per step, recorded at that last micro-batch). The result equals the
    per-micro-batch one up to the order of the fp32 sums (each rank sums its micro-batches first, then the ranks are
    summed; per micro-batch the ranks are summed first), so the two agree within rounding, not bit for bit. Nothing
    of it outlives a step: checkpoints are taken at step boundaries, after the reduce. Tests:
    ``tests/test_partitioned_state.py``, ``tests/test_trainer_ddp.py``.

Note: [Gradients reduced on the device skip the other ranks' D2H]
    With the plan's ``dp_reduce == "device"`` (`lazytrain_hf.planner.dpreduce`; the trainer then sets
    ``owner_device_reducer``) a unit's gradients are reduced to its owner where they are complete, on the device,
    before anything crosses PCIe: when the unit's backward is complete every rank calls ``owner_device_reducer(unit,
    grads, owner)`` on its device gradients (one tensor per trainable parameter in a fixed order, zeros where a
    parameter got none, as for the replicated ``grad_reducer``), which sums them into the owner's in place and
    divides the owner's by the world size (NCCL on CUDA, gloo on the CPU device: the same code path). The owner then
    goes on exactly as one process does with the rank mean of this micro-batch (its D2H copy into its accumulator,
    the norm on the device when the micro-batch is the first and last of the step, else on the host: Note: [Squared
    norms of accumulated gradients]); no host reduce follows. Any other rank copies nothing of the unit D2H (no
    staging, no host reduce): its trace has no ``d2h`` bytes for that unit and records the reduce on the lane ``net``
    as ``reduce_device`` with the unit's gradient bytes in their dtype. The reduce runs every micro-batch (a
    non-owner has no accumulator), on the thread that runs the backward, in the compute stream's order: on CUDA a
    synchronous NCCL call makes the current (compute) stream wait for the reduce, so the owner's D2H copy, recorded
    after it on that stream, copies the reduced gradient, and the next layer's backward starts after it (the
    simulator replays that); the non-owners' gradients are dropped behind it (NCCL records its use of them on its
    stream). With bf16 gradients the sum is taken in bf16, as DDP does, where the host path sums fp32 copies. Every
    rank completes its units in the same order, so the reduces pair up. Tests: ``tests/test_trainer_ddp.py``
    (``dp_reduce="device"``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

from .. import pinned
from ..activations.tiers import simulated_host_lead
from .binder import LayerState

# Note: [Partitioned gradients are reduced to their owner every micro-batch]: units' gradients staged at once
REMOTE_STAGING_UNITS = 2

# Elements per piece of a squared norm taken in fp32 over a lower-precision gradient (`squared_norm`)
NORM_CHUNK = 1 << 24


def squared_norm(g: torch.Tensor) -> torch.Tensor:
    """``|g|^2`` in fp32. ``vector_norm(g, dtype=float32)`` converts the whole tensor to fp32 first: for a bf16
    gradient of 311M elements (a 3B model's embedding) a 1.2 GB temporary. A lower-precision gradient larger than
    `NORM_CHUNK` elements is therefore normed in pieces of that many, their squares summed in fp32."""
    if g.dtype == torch.float32 or g.numel() <= NORM_CHUNK:
        return torch.linalg.vector_norm(g, dtype=torch.float32).square()
    sq = torch.zeros((), dtype=torch.float32, device=g.device)
    for piece in g.reshape(-1).split(NORM_CHUNK):
        sq = sq + torch.linalg.vector_norm(piece, dtype=torch.float32).square()
    return sq


class RemoteGradStaging:
    """Note: [Partitioned gradients are reduced to their owner every micro-batch]
    `REMOTE_STAGING_UNITS` fp32 buffers of ``numel`` elements (the largest unit owned elsewhere; registered when
    ``pin``) for the gradients of units whose accumulator another rank owns. `acquire` hands out a buffer once the
    reduce of its previous unit ran (`release`, on the worker thread), counting a host wait when it has to block."""

    def __init__(self, numel: int, pin: bool, on_wait: Callable[[str], None]):
        self._pins: list = []
        self.buffers = [
            pinned.pinned_empty(numel, torch.float32, pin, self._pins, "remote gradient staging")
            for _ in range(REMOTE_STAGING_UNITS)
        ]
        self._free = [threading.Event() for _ in self.buffers]
        for ev in self._free:
            ev.set()
        self._next = 0
        self._on_wait = on_wait

    def __repr__(self) -> str:
        return f"RemoteGradStaging({len(self.buffers)} x {self.buffers[0].numel()} fp32)"

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * 4 for b in self.buffers)

    def acquire(self) -> int:
        k = self._next
        self._next = (k + 1) % len(self.buffers)
        if not self._free[k].is_set():
            self._on_wait("remote gradient staging reused after its reduce")
            self._free[k].wait()
        self._free[k].clear()
        return k

    def release(self, k: int) -> None:
        self._free[k].set()

    def close(self) -> None:
        """Free the buffers; the caller drained the worker first (`StreamHandle.remove` synchronises)."""
        for block in self._pins:
            block.release()
        self._pins.clear()


class GradientSink:
    """`StreamHandle`'s gradient handling (see the module docstring)."""

    # Note: [Squared norms of accumulated gradients]: whether the backward in progress is the last micro-batch of
    # the optimizer step; a bool or a callable returning one (the trainer passes its gradient state).
    last_micro_batch: bool | Callable[[], bool] = True
    # Note: [Data parallel reduces the host accumulators once per step]: called as host_grad_reducer(layer, [flat])
    # on the layer's flat fp32 host accumulator after the last micro-batch's addition, before its norm is taken.
    host_grad_reducer: Callable[[int, list[torch.Tensor]], None] | None = None
    # Note: [Partitioned gradients are reduced to their owner every micro-batch]: owner_grad_reducer(unit, flat,
    # owner, last), set with `unit_owners`
    owner_grad_reducer: Callable[[int, torch.Tensor, int, bool], None] | None = None
    # Note: [Gradients reduced on the device skip the other ranks' D2H]: owner_device_reducer(unit, grads, owner)
    owner_device_reducer: Callable[[int, list[torch.Tensor], int], None] | None = None
    # Note: [Gradients reduced once per step]: the plan's dp_reduce_every ("micro_batch" or "step")
    dp_reduce_every: str = "micro_batch"
    # norm passes taken so far: over device gradients, over host accumulators (Note: [Squared norms of accumulated
    # gradients]); read after `synchronize`
    device_norm_passes: int = 0
    host_norm_passes: int = 0

    def _is_last_micro_batch(self) -> bool:
        last = self.last_micro_batch
        return bool(last() if callable(last) else last)

    def _host_sync(self, reason: str) -> None:
        trace = getattr(self, "trace", None)
        if trace is not None:
            trace.host_sync(reason)

    def _complete(self, i: int) -> None:
        """Move the layer's gradients to the host, take their norm, free them, release the slot."""
        st = self._all[i]
        st.completed = True
        self._account()  # the layer's device gradients are all there now: the backward high-water mark
        ls = st.store
        on_device = ls is not None and self._reduce_on_device(i, ls)
        if ls is not None and ls.remote:
            if on_device:  # Note: [Gradients reduced on the device skip the other ranks' D2H]
                self.sq_norms.pop(i, None)
                self._run_callbacks(i)
            elif self.dp_reduce_every == "step":
                self._complete_remote_step(i, ls)  # Note: [Gradients reduced once per step]
            else:
                self._complete_remote(i, ls)  # Note: [Partitioned gradients are reduced to their owner every ...]
            self._drop_device_grads(st)
        elif ls is not None and ls.grad is not None:
            fresh = not ls.has_grad
            last = self._is_last_micro_batch()
            to_owner = self.owner_grad_reducer is not None and not on_device
            to_owner = to_owner and (last or self.dp_reduce_every != "step")  # Note: [Gradients reduced once per step]
            reduce = to_owner or (last and self.host_grad_reducer is not None)
            spilled = self._spilled(i)
            if spilled:
                # the accumulator is a host window over the unit's file (lazytrain_hf.streaming.nvmestate)
                self._wait_written_back(i)
                read = self.nvme_state.open_grad(i, ls, accumulate=not fresh, defer_read=True)
                if read is not None:
                    # the accumulated gradient is read by the host worker, in order before this micro-batch's
                    # addition (only the worker touches the window until then), not on the training thread
                    self.engine.offload_grads([], accumulate=True, after=read)
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
            # Note: [Squared norms of accumulated gradients]
            device_norm = last and fresh and not reduce
            if device_norm:
                sq = torch.zeros((), dtype=torch.float32, device=self.device)
                for g, _ in pairs:
                    sq = sq + squared_norm(g)
                self.sq_norms[i] = sq
                self.device_norm_passes += 1
            else:
                self.sq_norms.pop(i, None)
            ls.has_grad = True
            after = self._after_offload(
                i, host_norm=last and not device_norm, reduce=reduce, spilled=spilled, last=last
            )
            self.engine.offload_grads(pairs, accumulate=not fresh, after=after, layer=i)
            self._drop_device_grads(st)
        elif self._callbacks:
            self._run_callbacks(i)
        self._release(i)
        if i == self.head_key and self._tied:
            self._release(self.embed_key)  # the lm_head's use of the tied weight is over too

    def _reduce_on_device(self, i: int, ls) -> bool:
        """Note: [Gradients reduced on the device skip the other ranks' D2H]
        Reduce unit ``i``'s complete device gradients to its owner when the plan says so; whether it did."""
        owners = getattr(self, "unit_owners", None)
        if self.owner_device_reducer is None or owners is None or owners.get(i, -1) < 0:
            return False
        grads = []
        for e in ls.trainable_entries:
            if e.param.grad is None:
                e.param.grad = torch.zeros_like(e.param)  # e.g. an expert no local token reached: it takes part
            grads.append(e.param.grad)
        if not grads:
            return False
        owner = owners[i]
        self.owner_device_reducer(i, grads, owner)
        if owner != self.rank:
            nbytes = sum(g.numel() * g.element_size() for g in grads)
            self.trace.transfer("net", nbytes, grads[0].dtype, i, "reduce_device")
        return True

    def _written_back(self) -> dict[int, threading.Event]:
        """Per unit whose state is on NVMe: an event set once its last gradient window was written back."""
        return self.__dict__.setdefault("_written_back_events", {})

    def _wait_written_back(self, i: int) -> None:
        """Note: [A unit's gradient window is written back before it is opened again]
        With the state on NVMe, micro-batch ``k``'s gradient window of unit ``i`` is written back to the unit's file
        by the host worker (`close_grad`, after the D2H copy landed); micro-batch ``k + 1``'s `open_grad` reads that
        file and rebinds the unit's gradient views to a new window. It must come after the write-back, or it reads a
        stale gradient and the worker writes into the new window (or a poisoned view). The worker sets the unit's
        event once its write-back ran; when it has not, the host drains the worker (counted as a host sync, and
        rare: a whole forward lies between a unit's two completions). Test:
        ``tests/test_cuda_semantics_host.py::test_state_nvme_write_back_precedes_the_next_micro_batch``."""
        written = self._written_back().get(i)
        if written is not None and not written.is_set():
            self._host_sync("gradient window written back before the next micro-batch")
            self.engine.synchronize()

    def _spilled(self, i: int) -> bool:
        spill = getattr(self, "nvme_state", None)
        return spill is not None and i in spill.units

    def _after_offload(
        self, i: int, host_norm: bool, reduce: bool = False, spilled: bool = False, last: bool = True
    ) -> Callable[[], None] | None:
        if not host_norm and not reduce and not self._callbacks and not spilled:
            return None
        if spilled:  # Note: [A unit's gradient window is written back before it is opened again]
            written = self._written_back()[i] = threading.Event()

        def after() -> None:
            ls = self.store.layers[i]
            flat = ls.grad
            if reduce and self.owner_grad_reducer is not None:
                # Note: [Partitioned gradients are reduced to their owner every micro-batch]
                self.owner_grad_reducer(i, flat, self.rank, last)
            elif reduce:
                # Note: [Data parallel reduces the host accumulators once per step]
                self.host_grad_reducer(i, [flat])
            if host_norm:
                self.sq_norms[i] = torch.dot(flat, flat)
                self.host_norm_passes += 1
            self._run_callbacks(i)
            if spilled:
                self.nvme_state.close_grad(i, ls)  # written back to the unit's file, the window released
                written.set()

        return after

    def _complete_remote(self, i: int, ls) -> None:
        """Note: [Partitioned gradients are reduced to their owner every micro-batch]
        A unit whose accumulator another rank owns: its device gradients go into a staging buffer, which the worker
        reduces to the owner once the copy landed; no norm is taken here."""
        if self.owner_grad_reducer is None:
            raise RuntimeError(
                f"unit {i}'s training state is owned by rank {self.unit_owners[i]}, but no owner_grad_reducer is set "
                "to send its gradients there (the trainer installs it with the data-parallel groups)."
            )
        staging = self.__dict__.get("_remote_staging")
        if staging is None:
            n = max(s.layout.train_elems for s in self.store.layers.values() if s.remote)
            staging = self.__dict__["_remote_staging"] = RemoteGradStaging(n, self.store.pin_memory, self._host_sync)
        k = staging.acquire()
        n = ls.layout.train_elems
        flat = staging.buffers[k].narrow(0, 0, n)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        end = 0
        for e in sorted(ls.trainable_entries, key=lambda e: e.elem_offset):
            # the alignment gaps too: the buffer held another unit's gradient, and the owner's norm is over the
            # whole flat accumulator the reduce sums into
            flat.narrow(0, end, e.elem_offset - end).zero_()
            end = e.elem_offset + e.numel
            view = flat.narrow(0, e.elem_offset, e.numel).view(e.shape)
            if e.param.grad is None:
                view.zero_()  # e.g. an expert no local token reached: it takes part with zeros
            else:
                pairs.append((e.param.grad, view))
        flat.narrow(0, end, n - end).zero_()
        self.sq_norms.pop(i, None)
        last, owner = self._is_last_micro_batch(), self.unit_owners[i]
        self.trace.transfer("net", n * 4, torch.float32, i, "reduce")

        def after() -> None:
            try:
                self.owner_grad_reducer(i, flat, owner, last)
            finally:
                staging.release(k)
            self._run_callbacks(i)

        self.engine.offload_grads(pairs, accumulate=False, after=after, layer=i)

    def _complete_remote_step(self, i: int, ls) -> None:
        """Note: [Gradients reduced once per step]
        A unit whose accumulator another rank owns, reduced once per step: its device gradients are added into this
        rank's own fp32 accumulator of it; after the last micro-batch's addition the worker reduces that to the
        owner."""
        if self.owner_grad_reducer is None:
            raise RuntimeError(
                f"unit {i}'s training state is owned by rank {self.unit_owners[i]}, but no owner_grad_reducer is set "
                "to send its gradients there (the trainer installs it with the data-parallel groups)."
            )
        d = self.__dict__
        accs, held = d.setdefault("_step_accumulators", {}), d.setdefault("_step_has_grad", set())
        acc = accs.get(i)
        if acc is None:  # zero-filled: the alignment gaps stay zero (the owner's norm covers the whole buffer)
            pins = d.setdefault("_step_pins", [])
            what = "accumulator of a unit owned elsewhere"
            acc = accs[i] = pinned.pinned_empty(
                ls.layout.train_elems, torch.float32, self.store.pin_memory, pins, what
            )
        fresh = i not in held
        held.add(i)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for e in ls.trainable_entries:
            view = acc.narrow(0, e.elem_offset, e.numel).view(e.shape)
            if e.param.grad is None:
                if fresh:
                    view.zero_()  # e.g. an expert no local token reached: it takes part with zeros
                continue
            pairs.append((e.param.grad, view))
        self.sq_norms.pop(i, None)
        last, owner = self._is_last_micro_batch(), self.unit_owners[i]
        if last:
            self.trace.transfer("net", acc.numel() * 4, torch.float32, i, "reduce")

        def after() -> None:
            if last:
                self.owner_grad_reducer(i, acc, owner, True)
            self._run_callbacks(i)

        self.engine.offload_grads(pairs, accumulate=not fresh, after=after, layer=i)

    @property
    def step_accumulator_bytes(self) -> int:
        """Bytes of this rank's accumulators of units owned elsewhere (Note: [Gradients reduced once per step]),
        `planner.hostmem`'s ``step_grads`` once every such unit has completed."""
        return sum(4 * a.numel() for a in self.__dict__.get("_step_accumulators", {}).values())

    def release_remote_staging(self) -> None:
        """Free the staging of gradients reduced to other ranks and the accumulators of units owned elsewhere
        (`remove()`)."""
        staging = self.__dict__.pop("_remote_staging", None)
        if staging is not None:
            staging.close()
        self.__dict__.pop("_step_accumulators", None)
        self.__dict__.pop("_step_has_grad", None)
        for block in self.__dict__.pop("_step_pins", []):
            block.release()

    def _run_callbacks(self, i: int) -> None:
        if not self._callbacks:
            return
        grads = self.layer_grads(i)
        for fn in list(self._callbacks.values()):
            fn(i, grads)

    def _drop_device_grads(self, st: LayerState) -> None:
        if st.store is None:
            return
        for e in st.store.trainable_entries:
            e.param.grad = None
        n = st.device_grad_bytes
        self._device_grad_bytes -= n
        st.device_grad_bytes = 0
        # Note: [Gradients freed behind their copy stay while the host leads]
        d = self.__dict__
        seq = d["_grad_seq"] = d.get("_grad_seq", 0) + 1
        d.setdefault("_grad_seq_of", {})[st.index] = seq
        lead = simulated_host_lead() if self.engine.is_async and not self.engine.is_cuda else 0
        if lead and n:
            d.setdefault("_deferred_grads", []).append((seq, n, lead))

    # Note: [Gradients freed behind their copy stay while the host leads]
    #     A layer's device gradients are dropped right after their D2H copy is queued, marked with
    #     ``record_stream`` (Note: [Gradient memory outlives its D2H copy] in engine.py): the caching allocator reuses
    #     the memory only once the device passed the copy. A host ``K`` layers ahead of the device (Note: [The host
    #     leads the device by two stages] in activations/tiers.py) allocates the next layers' gradients meanwhile, so
    #     ``K`` layers of gradients are on the device, however early the host dropped them. The simulated host lead
    #     (``LAZYTRAIN_SIMULATE_HOST_LEAD``) keeps such gradients counted as device bytes until ``K`` completions
    #     later or until the host waited for a gradient copy issued at or after theirs (`TransferEngine.wait_grads_down`
    #     waits on the host for layer ``i + 2``'s copy in the backward of layer ``i``). Test:
    #     ``tests/test_cuda_semantics_host.py::test_host_lead_is_bounded_in_backward``.
    @property
    def _device_grad_bytes(self) -> int:
        """Bytes of layer gradients on the device: waiting for their copy, or freed behind it but (with a simulated
        host lead) not known to be passed by the device yet."""
        d = self.__dict__
        deferred = d.get("_deferred_grads")
        if deferred:
            seq_of = d.get("_grad_seq_of", {})
            waited = seq_of.get(getattr(self.engine, "grads_down_layer", None), 0)
            now = d.get("_grad_seq", 0)
            deferred[:] = [(s, n, k) for s, n, k in deferred if s > waited and now - s < k]
        return d.get("_live_grad_bytes", 0) + sum(n for _, n, _ in deferred or ())

    @_device_grad_bytes.setter
    def _device_grad_bytes(self, value: int) -> None:
        self.__dict__["_live_grad_bytes"] = value - sum(n for _, n, _ in self.__dict__.get("_deferred_grads", ()))

    def synchronize(self) -> None:
        """Wait until every gradient copy and host accumulation issued so far has finished."""
        self.engine.synchronize()
        self.__dict__.pop("_deferred_grads", None)  # the device passed every copy

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
            if self._spilled(i) and not hasattr(st.store, "_grad_window"):
                out.update(self.nvme_state.read_grads(i, st.store))  # copies read from the unit's file
            else:
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
                if self._spilled(st.index):
                    out.update(self.nvme_state.read_grads(st.index, st.store))  # copies read from the unit's file
                else:
                    out.update(st.store.grad_views)
        for n, p, _ in self._resident:
            if p.grad is not None:
                out[n] = p.grad
        return out

    def zero_grad(self) -> None:
        """Forget accumulated gradients. Host accumulators are not cleared (a pass over all of host memory); the
        next layer completion overwrites them instead of adding, see `StreamHandle.grads`."""
        self.synchronize()
        for ls in self.store.layers.values():
            ls.has_grad = False
        self.__dict__.pop("_step_has_grad", None)  # Note: [Gradients reduced once per step]: overwritten next
        self.sq_norms.clear()
        for _, p, _ in self._resident:
            p.grad = None

    def grad_sq_norms(self) -> dict[int | str, float]:
        """Squared L2 norms of the accumulated gradients: ``{layer_index: float}`` for every layer with host
        gradients, plus ``"resident"`` for all resident parameters (embeddings, final norm, lm_head, adapters).

        The values on the device are read back together (one host synchronisation); a layer whose norm was not
        taken (Note: [Squared norms of accumulated gradients]) gets it from its host accumulator now."""
        self.synchronize()
        for i, st in self._all.items():
            ls = st.store
            if ls is not None and ls.grad is not None and ls.has_grad and i not in self.sq_norms:
                if self._spilled(i):
                    flat = torch.cat([g.reshape(-1) for g in self.nvme_state.read_grads(i, ls).values()])
                    self.sq_norms[i] = torch.dot(flat, flat)
                else:
                    self.sq_norms[i] = torch.dot(ls.grad, ls.grad)
                self.host_norm_passes += 1
        keys: list[int | str] = sorted(self.sq_norms)
        vals = [self.sq_norms[i] for i in keys]
        res = torch.zeros((), dtype=torch.float32, device=self.device)
        for _, p, _ in self._resident:
            if p.grad is not None:
                res = res + squared_norm(p.grad).to(res.device)
        keys.append("resident")
        vals.append(res)
        on_device = [k for k, v in enumerate(vals) if v.device.type != "cpu"]
        host = [float(v) if v.device.type == "cpu" else 0.0 for v in vals]
        if on_device:
            self._host_sync("gradient norms")
            fetched = torch.stack([vals[k] for k in on_device]).cpu()
            for j, k in enumerate(on_device):
                host[k] = float(fetched[j])
        return dict(zip(keys, host))

    def global_grad_norm(self) -> float:
        """L2 norm of every gradient accumulated since `zero_grad` (streamed and resident)."""
        return math.sqrt(sum(self.grad_sq_norms().values()))
