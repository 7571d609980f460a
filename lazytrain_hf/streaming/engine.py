"""Transfer engine: the device slot pool and every host <-> device copy of the streaming executor.

One interface, three paths:

- **CPU** (the development machines): the "device" is the CPU. Slots are real buffers distinct from the host
  store, so every fetch is a real copy (synchronous), and gradients are really copied / added into the host
  accumulators.
- **CUDA**: an H2D lane and a D2H lane (`lazytrain_hf.streams`: CUDA streams), events instead of host
  synchronisation, pinned host buffers and ``non_blocking=True`` copies. Host-side work that must wait for a D2H
  copy (adding a micro-batch gradient into the fp32 accumulator, per-layer callbacks) runs on one background worker
  thread, so the Python thread driving autograd never blocks per layer.
- **Simulated asynchronous CPU** (``LAZYTRAIN_SIMULATE_ASYNC=1``): the CUDA path's code with simulated lanes:
  every copy lands on a worker thread after a random delay, its destination poisoned meanwhile, and slots handed
  back to the pool are poisoned (`lazytrain_hf.streams`). The tests run under it, so a missing wait fails them.

The invariants the asynchronous paths rely on are named Notes below and referenced where they are relied on; the
test that exercises each is named in it.

Note: [Slot reuse waits for the compute event]
    A slot is handed back to the pool by `release` while kernels that read it may still be queued on the compute
    stream. `release` records ``slot.released`` on the compute stream; the next H2D copy into that slot is issued
    on the H2D lane after ``slot.released``, so it cannot overwrite weights a queued kernel still reads. A slot the
    plan keeps resident is never released: the optimizer's upload into it follows `mark_released`, which the
    updater calls on the training thread once the step's backward is queued. A copy into a slot the compute side
    bound (`wait_ready`) and has not released since is refused with an error. Tests:
    ``test_plan_space.py::test_resident_upload_needs_release`` (the error), the plan-space property test (values).

Note: [Compute waits for the H2D event]
    A fetch records ``slot.ready`` on the H2D lane after its copy; `wait_ready` makes the current (compute)
    stream wait for it before the layer's parameters are bound to the slot and used, and before every forward of
    a resident layer (whose slot the optimizer's upload rewrites between steps). Test: the plan-space property test
    (a read before the copy landed sees NaN).

Note: [Host compute copy is not rewritten while a fetch reads it]
    An H2D copy reads the pinned host compute copy asynchronously. Each fetch records ``host_read[layer]``;
    `wait_host_reads(layer)` blocks the host until that copy finished and must be called before the optimizer
    (or `LayerStore.sync`) rewrites the compute copy. Conversely the trainer updates layer ``i`` before the next
    step's forward fetches it, and before the forward of a resident layer ``i`` (``StreamHandle.fetch_guard``; Note:
    [Update before fetch] in training/updater.py). Tests: the plan-space property test with ``optimizer_overlap`` (the
    update-before-fetch half). The first half is not observable on the CPU: the simulated compute side waits for a
    copy on the host (Note: [Compute is synchronous in the simulation] in lazytrain_hf/streams.py), so no fetch is
    still reading when the optimizer runs; on CUDA the host runs ahead of the copy and this wait is what orders it.

Note: [Gradient memory outlives its D2H copy]
    A device gradient handed to `offload_grads` is dropped by the caller right after. ``record_stream(d2h)``
    tells the caching allocator not to reuse its memory until the D2H stream passed the copy (`Lane.hold`; the
    simulated lane's job holds the tensor); the D2H lane first waits for the compute stream, which produced the
    gradient. Test: the plan-space property test (gradients compared bit for bit).

Note: [Host accumulators are read only after their copy landed]
    A gradient in the accumulator's dtype (fp32) crosses straight into the pinned fp32 accumulator on the first
    micro-batch after ``zero_grad``; every other gradient (later micro-batches, and every bf16 gradient: Note:
    [Gradients cross in their own dtype]) crosses into a pinned staging buffer that the worker adds (or copies,
    upcasting) into the accumulator once the copy's event completed.
    Everything that reads the accumulators (`StreamHandle.grads`, the optimizer's `LayerwiseUpdater.run`,
    ``zero_grad``) calls `synchronize` first, which waits for every pending event and drains the worker. Test:
    ``test_plan_space.py::test_updater_synchronizes_what_it_reads``.

Note: [Gradients cross in their own dtype]
    ``host_fp32.copy_(dev_bf16, non_blocking=True)`` converts on the device first: 4 bytes per parameter cross
    PCIe plus an fp32 temporary per parameter on the device. A gradient whose dtype is not the accumulator's is
    therefore copied into a staging buffer of its own dtype and upcast on the host by the worker, so a bf16
    gradient moves 2 bytes per parameter (what the planner counts, `lazytrain_hf.planner.schedule`). Staging
    buffers come from `_StagingPool`, reused once the worker consumed them (at most ``STAGING_BUFFERS`` free ones
    are kept per dtype and size class); with at most two layers' gradients in flight (Note: [Two stages of copies in
    flight]) pinned staging stays within a few layers' gradients. Test: ``tests/test_trace.py`` (bytes and dtype of every
    gradient transfer of a bf16 model).

Note: [Two stages of copies in flight]
    Offloads and gradients leave the device on the D2H lane while compute goes on; if that lane is slower than
    compute, their sources would pile up on the device. The forward of layer ``i`` therefore waits for the offload
    copies of layer ``i - 2`` (the head stage for those of ``L - 2``, the last layer's backward stage for its own),
    and the backward stage of layer ``i`` for the gradient copies of layer ``i + 2`` (the head unit's for ``L - 2``):
    at most two stages of copies are in flight, the memory and time the planner's stage model charges (a copy issued
    after stage ``s`` occupies stage ``s + 1``). The compute stream waits, and so does the host (a host sync only
    when the copy has not landed): a source is freed only once the host knows its copy ran, so a host far ahead of
    the device would hold many stages of them (Note: [The host leads the device by two stages] in
    activations/tiers.py, Note: [Gradients freed behind their copy stay while the host leads] in gradients.py).
    Tests: ``tests/test_trace.py::test_copies_in_flight_are_bounded*`` (the simulator and the stage model then agree
    on peak memory), ``tests/test_cuda_semantics_host.py::test_host_lead_is_bounded*``.

Every copy is recorded in the handle's trace (`lazytrain_hf.streaming.trace`), and so is every point where the
training thread blocks on device work (``Trace.host_sync``).
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from .. import pinned
from ..streams import SimDelay, lanes_for, pin_host_memory, poison_
from ..threads import background_worker, on_step_path
from .trace import Trace

# Note: [Gradients cross in their own dtype]: staging buffers per (dtype, size) kept for reuse
STAGING_BUFFERS = 2


@dataclass
class Slot:
    """One device buffer holding the compute copy of one layer at a time."""

    kind: str
    buffer: torch.Tensor  # uint8, on the device
    pooled: bool = True
    transient: bool = False  # allocated for one fetch and freed by `release` (embeddings, final norm, lm_head)
    owner: int | None = None  # layer currently bound to (or being fetched into) this slot
    # the lane event of the last copy into the slot, or the `ReadThenCopy` of a fetch whose read is queued; see Note:
    # [Compute waits for the H2D event]
    ready: Any = None
    released: Any = None  # see Note: [Slot reuse waits for the compute event]
    compute_open: bool = False  # bound by the compute side and not released since (no copy into it allowed)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def storage_ptr(self) -> int:
        return self.buffer.untyped_storage().data_ptr()

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole slot as a flat tensor of ``dtype`` (slot sizes are multiples of 256 bytes)."""
        return self.buffer.view(dtype)


class TransferEngine:
    """Device slot pool plus H2D / D2H copies.

    Args:
        device: the compute device (``cpu`` or ``cuda[:i]``).
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        # None: synchronous CPU copies; else CUDA streams or the simulated asynchronous lanes
        self.lanes = lanes_for(self.device, ("h2d", "d2h"), "transfer")
        self.is_async = self.lanes is not None
        # simulated lanes on the CPU (lazytrain_hf.streams): binding models CUDA's device moves (Note: [Moving a
        # parameter's data drops its gradient accumulator])
        self.simulated = self.is_async and not self.is_cuda
        self.pools: dict[str, list[Slot]] = {}
        self._free: dict[str, list[Slot]] = {}
        self._slot_bytes: dict[str, int] = {}
        self.by_ptr: dict[int, Slot] = {}
        self.grown: dict[str, int] = {}
        self._host_read: dict[int, torch.cuda.Event] = {}
        self._host_read_lock = threading.Lock()  # the training and the optimizer thread both read and write it
        self._grad_events: dict[int, Any] = {}  # layer -> its last gradient D2H copy (Note: [Two stages of ...])
        self._pending: list[torch.cuda.Event] = []
        # the gradient worker; simulated, it stalls like a lane (Note: [Every background worker stalls for longer
        # than a forward] in lazytrain_hf/streams.py)
        self._worker: _HostWorker | None = (
            _HostWorker(SimDelay("grad-worker") if self.simulated else None) if self.is_async else None
        )
        self.fetch_count = 0
        self.fetch_bytes = 0
        self.trace = Trace(device=self.device)
        self._staging = _StagingPool(pin=pin_host_memory(self.device))

    def __repr__(self) -> str:
        pools = ", ".join(f"{k}: {len(v)} x {self._slot_bytes[k]}B" for k, v in self.pools.items())
        return f"TransferEngine(device={self.device}, pools={{{pools}}}, fetches={self.fetch_count})"

    # ------------------------------------------------------------------ slots
    def _new_slot(self, kind: str, nbytes: int, pooled: bool) -> Slot:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        slot = Slot(kind=kind, buffer=buf, pooled=pooled)
        if self.is_async:
            # the buffer comes from the caching allocator on the compute stream, whose queued kernels may still use
            # that memory: the first fill waits for them like a refill (Note: [Slot reuse waits for the compute event])
            slot.released = self.lanes.compute_event()
        self.by_ptr[slot.storage_ptr] = slot
        return slot

    def add_pool(self, kind: str, slot_bytes: int, count: int) -> None:
        """Allocate ``count`` slots of ``slot_bytes`` for layers of ``kind``."""
        self._slot_bytes[kind] = slot_bytes
        slots = [self._new_slot(kind, slot_bytes, True) for _ in range(count)]
        self.pools[kind] = slots
        self._free[kind] = list(slots)

    def dedicated_slot(self, kind: str, nbytes: int) -> Slot:
        """A slot outside the pool, for a layer the plan keeps resident for the whole step."""
        return self._new_slot(kind, nbytes, False)

    def transient_slot(self, kind: str, nbytes: int) -> Slot:
        """A slot allocated for one fetch and freed by `release`: for parts fetched once or twice per step (the
        embeddings, final norm and lm_head when the plan streams them), whose memory a pool would hold for good.

        Note: [Transient slots are stream-ordered allocations]
            The buffer comes from the caching allocator on the compute stream, so its memory may have just been
            freed by compute kernels still queued. ``slot.released`` is recorded on the compute stream at
            allocation, and the H2D copy waits for it like a reused slot (Note: [Slot reuse waits for the compute
            event]); the buffer is marked as used by the H2D stream as its copy is issued (`_h2d`; by the reader
            thread for a fetch from NVMe, whose copy `release` waits to be issued), so freeing it in `release` (on
            the compute stream, after the compute waited for ``slot.ready``) cannot hand its memory out before the
            copy ran.
        """
        slot = self._new_slot(kind, _align256(nbytes), False)
        slot.transient = True
        if self.is_async:
            slot.released = self.lanes.compute_event()
        return slot

    def acquire(self, kind: str, urgent: bool) -> Slot | None:
        """A free slot of ``kind``; ``None`` when the pool is exhausted and the fetch is a prefetch (it is retried
        at the next stage). An urgent fetch (the layer is needed now) grows the pool by one slot with a warning,
        rather than deadlocking: a slot can only be freed by backward progress that the urgent fetch blocks."""
        free = self._free[kind]
        if free:
            return free.pop()
        if not urgent:
            return None
        warnings.warn(
            f"lazytrain_hf streaming: the slot pool for {kind!r} layers ({len(self.pools[kind])} slots) is exhausted;"
            " allocating one more slot. Raise the pool size (stream slots) or lower the prefetch depth of the plan.",
            stacklevel=3,
        )
        slot = self._new_slot(kind, self._slot_bytes[kind], True)
        self.pools[kind].append(slot)
        self.grown[kind] = self.grown.get(kind, 0) + 1
        return slot

    def release(self, slot: Slot) -> None:
        """Hand a slot back to the pool. See Note: [Slot reuse waits for the compute event]."""
        if self.is_async:
            # a fetch never used: its copy is issued before the slot's next copy, or its buffer's free (Note: [A
            # fetch from NVMe is read off the step's threads] in nvmestate.py)
            self._issued(slot, "a fetch from NVMe released before its read landed", strict=False)
        self.mark_released(slot)
        slot.owner = None
        if slot.transient:
            # Note: [Transient slots are stream-ordered allocations]
            self.by_ptr.pop(slot.storage_ptr, None)
            slot.buffer = slot.buffer.new_empty(0)
            return
        if slot.pooled:
            if self.is_async:
                self.lanes.poison_after(slot.buffer, slot.ready)  # Note: [Simulated copies poison their destination]
            self._free[slot.kind].append(slot)

    def mark_released(self, slot: Slot) -> None:
        """The compute side is done with what it queued on ``slot`` so far: a copy into it may follow.

        See Note: [Slot reuse waits for the compute event].
        """
        if self.is_async:
            slot.released = self.lanes.compute_event()
        slot.compute_open = False

    @property
    def slot_bytes(self) -> int:
        """Bytes of every slot allocated (pooled and dedicated)."""
        return sum(s.nbytes for s in self.by_ptr.values())

    # ------------------------------------------------------------------ H2D
    def _check_copy_in(self, slot: Slot, n: int, layer: int) -> None:
        if n > slot.nbytes:
            raise RuntimeError(f"layer {layer} needs {n} bytes but its {slot.kind!r} slot has {slot.nbytes}.")
        if slot.compute_open:
            raise RuntimeError(
                f"lazytrain_hf streaming: a copy of layer {layer} into a {slot.kind!r} slot that the compute side "
                "bound and has not released; it could overwrite weights queued kernels still read. See Note: [Slot "
                "reuse waits for the compute event] in lazytrain_hf/streaming/engine.py."
            )
        if self.simulated and slot.released is None:
            raise RuntimeError(
                f"lazytrain_hf streaming: a copy of layer {layer} into a {slot.kind!r} slot that is not ordered after "
                "the compute stream (slot.released is None); its memory may still be in use by queued kernels. See "
                "Note: [Slot reuse waits for the compute event] in lazytrain_hf/streaming/engine.py."
            )

    def _start_copy_in(self, slot: Slot, n: int, layer: int, what: str) -> None:
        slot.owner = layer
        self.fetch_count += 1
        self.fetch_bytes += n
        self.trace.transfer("h2d", n, "uint8", layer, what)

    def copy_in(self, slot: Slot, src_bytes: torch.Tensor, layer: int, what: str = "fetch") -> None:
        """Copy a layer's compute copy (uint8 host buffer) into ``slot`` (``what``: ``fetch``, or ``upload`` of a
        resident layer after its update)."""
        n = src_bytes.numel()
        self._check_copy_in(slot, n, layer)
        self._start_copy_in(slot, n, layer, what)
        dst = slot.buffer.narrow(0, 0, n)
        if not self.is_async:
            dst.copy_(src_bytes)
            return
        slot.ready = self._h2d(slot, dst, src_bytes)
        # Note: [Host compute copy is not rewritten while a fetch reads it]; the optimizer thread uploads too
        with self._host_read_lock:
            self._host_read[layer] = slot.ready

    def copy_in_from_read(
        self, slot: Slot, nbytes: int, layer: int, submit: Callable[[Callable[[torch.Tensor], Any]], Future]
    ) -> None:
        """Fetch into ``slot`` a compute copy of ``nbytes`` that a background reader has yet to read (a unit whose
        state is on NVMe; asynchronous engines only): ``submit(issue)`` queues the read and returns its Future; the
        reader calls ``issue(window)`` once the window holds the bytes, which issues the window's H2D copy and
        returns its event (the Future's result). Nothing here waits: the slot's readiness covers the read and the
        copy (`wait_ready`). See Note: [A fetch from NVMe is read off the step's threads] in nvmestate.py."""
        if not self.is_async:
            raise RuntimeError("copy_in_from_read needs an asynchronous engine; read first and use copy_in.")
        self._check_copy_in(slot, nbytes, layer)
        dst = slot.buffer.narrow(0, 0, nbytes)
        if self.simulated:
            poison_(dst)  # from the fetch on, as a lane copy does when issued (Note: [Simulated copies poison ...])
        released = slot.released

        def issue(window: torch.Tensor) -> Any:  # on the reader thread
            return self._h2d(slot, dst, window.narrow(0, 0, nbytes), released)

        slot.ready = ReadThenCopy(submit(issue))
        self._start_copy_in(slot, nbytes, layer, "fetch")
        with self._host_read_lock:
            self._host_read[layer] = slot.ready

    def _h2d(self, slot: Slot, dst: torch.Tensor, src: torch.Tensor, released: Any = None) -> Any:
        """Issue the copy into ``slot`` on the H2D lane after ``released`` (the slot's release when the copy was
        asked for; Note: [Slot reuse waits for the compute event]); its event."""
        lane = self.lanes["h2d"]
        if slot.transient:
            lane.hold(slot.buffer)  # Note: [Transient slots are stream-ordered allocations]
        return lane.copy(dst, src, after=(slot.released if released is None else released,))

    def _issued(self, slot: Slot, why: str, strict: bool = True) -> Any:
        """The lane event of the slot's last copy, once a `ReadThenCopy` fetch issued it (a host sync on the step's
        threads when its read has not landed yet: ``why``). ``strict``: re-raise the read's error; else the slot's
        copy is None (nothing was copied)."""
        ready = slot.ready
        if isinstance(ready, ReadThenCopy):
            if not ready.future.done() and on_step_path():
                self.trace.host_sync(why)
            try:
                slot.ready = ready.future.result()
            except Exception:
                if strict:
                    raise
                slot.ready = None
        return slot.ready

    def wait_ready(self, slot: Slot) -> None:
        """Make the compute stream wait for the slot's fetch before it uses the slot. See Note: [Compute waits for
        the H2D event]."""
        slot.compute_open = True
        self.trace.waited(slot.owner, "fetch")
        if self.is_async:
            # Note: [A fetch from NVMe is read off the step's threads] in nvmestate.py
            self.lanes.compute_wait(self._issued(slot, "a fetch waits for its read from NVMe"))

    def wait_host_reads(self, layer: int) -> None:
        """Block until no fetch reads the host compute copy of ``layer``.

        See Note: [Host compute copy is not rewritten while a fetch reads it].
        """
        with self._host_read_lock:
            ev = self._host_read.pop(layer, None)
        if ev is not None:
            # the training or autograd thread, not the optimizer's (Note: [Backward runs on another thread])
            if on_step_path():
                self.trace.host_sync("wait_host_reads")
            ev.synchronize()

    def upload(self, slot: Slot, src_bytes: torch.Tensor, layer: int | None = None) -> None:
        """Refresh a dedicated (resident) slot from the host after an optimizer step, ordered like a fetch: after
        `mark_released`; the layer's next forward waits for it (`wait_ready`)."""
        self.copy_in(slot, src_bytes, slot.owner if layer is None else layer, what="upload")

    # ------------------------------------------------------------------ D2H
    def offload_grads(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        accumulate: bool,
        after: Callable[[], None] | None = None,
        layer: int | None = None,
    ) -> None:
        """Move device gradients into host fp32 accumulators: ``host.copy_(dev)`` (first micro-batch since
        ``zero_grad``) or ``host += dev``; then run ``after`` (on the worker thread on CUDA, once the data landed).

        The caller may drop the device gradients right after this returns. Each gradient crosses in its own dtype
        (Note: [Gradients cross in their own dtype]).
        """
        if pairs:
            nbytes = sum(dev.numel() * dev.element_size() for dev, _ in pairs)
            self.trace.transfer("d2h", nbytes, pairs[0][0].dtype, layer, "grad")
        if not self.is_async:
            with torch.no_grad():
                for dev, host in pairs:
                    if accumulate:
                        host.add_(dev)
                    else:
                        host.copy_(dev)
            if after is not None:
                after()
            return
        lane = self.lanes["d2h"]
        staged: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (pool buffer, its view, accumulator)
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dev, host in pairs:
            if accumulate or dev.dtype != host.dtype:
                # Note: [Host accumulators are read only after their copy landed]
                full = self._staging.get(dev.dtype, dev.numel())
                buf = full.narrow(0, 0, dev.numel()).view(dev.shape)
                copies.append((buf, dev))
                staged.append((full, buf, host))
            else:
                copies.append((host, dev))
            lane.hold(dev)  # Note: [Gradient memory outlives its D2H copy]
        # the gradients were produced on the compute stream
        ev = lane.copy_all(copies, after_compute=True) if copies else None
        if ev is not None and layer is not None:
            self._grad_events[layer] = ev
        if not staged and after is None:
            if ev is not None:
                self._pending.append(ev)
            return
        pool = self._staging
        poison = self.is_async and not self.is_cuda  # Note: [Simulated copies poison their destination]

        def work() -> None:
            if ev is not None:
                ev.synchronize()
            with torch.no_grad():
                for full, buf, host in staged:
                    if accumulate:
                        host.add_(buf)
                    else:
                        host.copy_(buf)  # upcast on the host
                    if poison:
                        poison_(full)
                    pool.put(full)
            if after is not None:
                after()

        self._worker.submit(work)

    def wait_grads_down(self, layer: int) -> None:
        """The compute side waits until ``layer``'s gradient copies left the device (Note: [Two stages of copies in
        flight]); a no-op when none is in flight."""
        ev = self._grad_events.pop(layer, None)
        if ev is not None:
            self.lanes.compute_wait(ev)
            # the host too, bounding its lead (Note: [Gradients freed behind their copy stay while the host leads]
            # in gradients.py); a host sync only when the copy has not landed yet
            if not ev.query():
                self.trace.host_sync("the host waits for the gradient copies of two layers back (its lead)")
                ev.synchronize()
            self.grads_down_layer = layer

    def synchronize(self) -> None:
        """Wait for every pending copy and host-side accumulation (no-op for synchronous CPU copies)."""
        if not self.is_async:
            return
        if self._pending or self._worker.busy:
            self.trace.host_sync("engine.synchronize")
        for ev in self._pending:
            ev.synchronize()
        self._pending.clear()
        self._worker.drain()
        self._grad_events.clear()
        # A fetch whose layer computed since has been read: the compute waited for it, and the gradient copies just
        # waited for are ordered after that compute. Forgetting those events (a non-blocking query) spares the
        # optimizer a host synchronisation per layer in `wait_host_reads`.
        with self._host_read_lock:  # the optimizer thread may be inserting (an upload of a resident layer)
            self._host_read = {k: ev for k, ev in self._host_read.items() if not ev.query()}

    def close(self) -> None:
        if self._worker is not None:
            self._worker.drain()
            self._worker.stop()
            self._worker = None
        if self.lanes is not None:
            self.lanes.synchronize()
            self.lanes.close()
        self.pools.clear()
        self._free.clear()
        self.by_ptr.clear()
        with self._host_read_lock:
            self._host_read.clear()


class ReadThenCopy:
    """The readiness of a slot whose fetch a background reader completes (`TransferEngine.copy_in_from_read`): the
    reader's job (``future``), whose result is the lane event of the H2D copy it issued once its read landed. Answers
    `query` / `synchronize` as a lane event does (`wait_host_reads`, `synchronize`); the compute side takes the
    copy's event from it (`TransferEngine.wait_ready`). Note: [A fetch from NVMe is read off the step's threads] in
    nvmestate.py."""

    __slots__ = ("future",)

    def __init__(self, future: Future):
        self.future = future

    def query(self) -> bool:
        if not self.future.done():
            return False
        if self.future.exception() is not None:
            return True  # nothing was copied
        ev = self.future.result()
        return ev is None or ev.query()

    def synchronize(self) -> None:
        ev = self.future.result()
        if ev is not None:
            ev.synchronize()

    def __repr__(self) -> str:
        return f"ReadThenCopy(issued={self.future.done()})"


def _align256(n: int) -> int:
    return (n + 255) // 256 * 256


class _StagingPool:
    """Pinned (registered, exact-size) staging buffers for gradients crossing to the host, by dtype and element count.

    See Note: [Gradients cross in their own dtype]. `get` returns a free buffer of ``numel`` elements or allocates
    one; `put`
    hands it back once the worker consumed it. At most `STAGING_BUFFERS` free buffers per class are kept.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self._blocks: dict[int, pinned.PinnedBlock] = {}  # address -> the registered block of a buffer
        self._lock = threading.Lock()
        self.allocated_bytes = 0

    def get(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A 1-D buffer of exactly ``numel`` elements, registered when ``pin`` (Note: [Pinned blocks are registered,
        not cached] in store.py: no power-of-two rounding; layers of one kind still share buffers)."""
        with self._lock:
            free = self._free.get((dtype, numel))
            if free:
                return free.pop()
            self.allocated_bytes += numel * dtype.itemsize
        if not self.pin:
            return torch.empty(numel, dtype=dtype)
        block = pinned.PinnedBlock(numel * dtype.itemsize, True, "gradient staging")
        buf = block.tensor.view(dtype)
        with self._lock:
            self._blocks[buf.data_ptr()] = block
        return buf

    def put(self, buf: torch.Tensor) -> None:
        """Hand back a buffer from `get` (its last reader is done)."""
        with self._lock:
            free = self._free.setdefault((buf.dtype, buf.numel()), [])
            if len(free) < STAGING_BUFFERS:
                free.append(buf)
                return
            self.allocated_bytes -= buf.numel() * buf.element_size()
            block = self._blocks.pop(buf.data_ptr(), None)
        if block is not None:
            block.release()


class _HostWorker:
    """One background thread running host-side work after D2H copies, in submission order.

    Exceptions raised by the work are re-raised by the next `drain`.
    """

    def __init__(self, delay: SimDelay | None = None):
        self._q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._error: BaseException | None = None
        self.delay = delay
        self._thread = threading.Thread(target=self._run, name="lazytrain-stream-host", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with background_worker():  # its waits do not stall the step (Note: [Backward runs on another thread])
            self._loop()

    def _loop(self) -> None:
        while True:
            fn = self._q.get()
            try:
                if fn is None:
                    return
                if self._error is None:
                    if self.delay is not None:
                        self.delay.sleep()
                    fn()
            except BaseException as e:  # surfaced on the caller's thread by drain()
                self._error = e
            finally:
                self._q.task_done()

    def submit(self, fn: Callable[[], None]) -> None:
        self._q.put(fn)

    @property
    def busy(self) -> bool:
        return self._q.unfinished_tasks > 0

    def drain(self) -> None:
        self._q.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("host-side gradient work failed on the streaming worker thread") from err

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)
