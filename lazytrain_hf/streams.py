"""Copy lanes of the executor: CUDA streams on a GPU, and the simulated asynchronous engine on the CPU.

The transfer engine (`streaming/engine.py`) and the activation engine (`activations.py`) issue every asynchronous
copy through a `Lane` and order work only through the events it returns:

- ``lane.copy(dst, src, after=...)`` issues ``dst.copy_(src)`` on the lane after the events in ``after`` (and, with
  ``after_compute=True``, after everything the compute stream queued so far) and returns the copy's event;
- ``lanes.compute_wait(ev)`` makes the compute side wait for ``ev`` before its next use of the data;
- ``lanes.compute_event()`` marks "the compute side is done with what it queued so far";
- ``ev.synchronize()`` / ``ev.query()`` block the host on / poll one event.

On CUDA a lane is a `torch.cuda.Stream`, events are `torch.cuda.Event`. On the CPU without simulation there are no
lanes (the engines copy synchronously). With ``LAZYTRAIN_SIMULATE_ASYNC=1`` the CPU gets lanes too: each is one
worker thread running its copies in issue order, each after a seeded random delay, and an event is set when its copy
landed. The engines then run exactly the code paths they run on CUDA, and a wait that is missing shows as a wrong
number instead of a pass:

Note: [Simulated copies poison their destination]
    A simulated copy fills its destination with NaN (all bytes 0xFF: NaN for fp32, bf16 and fp16) when it is
    issued and writes the data only when it runs, so a read that does not wait for the copy's event sees NaN (or,
    for a copy into memory that held the right values before, garbage) rather than the values. Buffers handed back
    to a pool are poisoned the same way once their last copy completed (`poison_after`).

Note: [Compute is synchronous in the simulation]
    The simulated "device" is the CPU thread that drives autograd, so compute never lags behind the host: a
    ``compute_event()`` is complete when it is made, and ``after_compute`` needs no wait. What this cannot show
    (a copy racing kernels still queued on a GPU's compute stream) is guarded by a check instead: a slot may only be
    overwritten after the compute side released it (`streaming/engine.py`, Note: [Slot reuse waits for the compute
    event]), which the simulation enforces with an error.

Note: [Moving a parameter's data drops its gradient accumulator]
    On CUDA, binding a streamed parameter to its slot (``param.data = slot_view``) and releasing it (back to the
    host view) change the parameter's device, and ``VariableHooks::set_data`` (torch/csrc/autograd/variable.cpp)
    then resets the parameter's gradient-accumulator weak reference: a parameter used, released and bound again
    within one forward gets a second ``AccumulateGrad`` node, and its post-accumulate-grad hook fires once per node.
    On the CPU the slot and the host copy share device and dtype, so `set_param_data` makes the simulation take a
    dtype detour on every bind and release: the accumulator is reset exactly where CUDA resets it. Test:
    ``tests/test_cuda_semantics_grad.py::test_simulated_bind_drops_the_grad_accumulator``.

Note: [Every background worker stalls for longer than a forward]
    Every simulated worker (each lane, the gradient worker of `streaming/engine.py`, the NVMe spill writer and
    reader, the overlapped optimizer thread) draws its delays from a `SimDelay`. Besides the short delays, a share
    of its jobs (``LAZYTRAIN_SIMULATE_ASYNC_STALL_SHARE``, default 0.02) stalls the worker for at least one
    forward's length: 1.5x the last forward the executor timed (`note_forward`), within `_LONG_STALL_MIN_S` and
    `_LONG_STALL_MAX_S` (a forward that itself waited on a stall must not lengthen the next stall without bound).
    ``LAZYTRAIN_SIMULATE_ASYNC_STALL_WORKERS`` (comma-separated name prefixes, e.g. ``optimizer,grad-worker``;
    default: every worker) limits the long stalls to some workers. A wait that is only "usually" unnecessary (work
    issued a whole layer or step earlier) then fails a test instead of passing because the worker happened to be
    quick. Tests: ``tests/test_cuda_semantics_grad.py::test_gradient_worker_stalls_are_waited_for``,
    ``::test_optimizer_thread_stalls_are_waited_for``, ``::test_nvme_writer_stalls_are_waited_for``.

Note: [Backward runs on another thread] is in `lazytrain_hf/threads.py` (which threads stand for the compute
stream; the simulation's autograd thread).

``LAZYTRAIN_SIMULATE_ASYNC_SEED`` (default 0) seeds the delays; ``LAZYTRAIN_SIMULATE_ASYNC_MAX_DELAY`` (seconds,
default 0.002) bounds them.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import pinned
from .threads import check_compute_thread, env_flag

SIMULATE_ENV = "LAZYTRAIN_SIMULATE_ASYNC"
SEED_ENV = "LAZYTRAIN_SIMULATE_ASYNC_SEED"
MAX_DELAY_ENV = "LAZYTRAIN_SIMULATE_ASYNC_MAX_DELAY"
STALL_SHARE_ENV = "LAZYTRAIN_SIMULATE_ASYNC_STALL_SHARE"
STALL_WORKERS_ENV = "LAZYTRAIN_SIMULATE_ASYNC_STALL_WORKERS"

# Shares of simulated jobs that run without any delay (a missing wait must also show when the copy is fast) and that
# stall their lane for up to 10x the usual bound (a copy issued long before its use must still be waited for).
_NO_DELAY_SHARE = 0.25
_STALL_SHARE = 0.05
# Note: [Every background worker stalls for longer than a forward]: default share of jobs that stall their worker for
# at least one forward, and the least such stall (a tiny test model's forward takes ~20-25 ms under the simulation)
_LONG_STALL_SHARE = 0.02
_LONG_STALL_MIN_S = 0.05
_LONG_STALL_MAX_S = 0.25
_last_forward_s = 0.0


def note_forward(seconds: float) -> None:
    """The executor timed a forward (simulation only): long stalls last at least this long."""
    global _last_forward_s
    _last_forward_s = float(seconds)


def long_stall_s() -> float:
    """How long a long stall lasts now (Note: [Every background worker stalls for longer than a forward])."""
    return min(_LONG_STALL_MAX_S, max(_LONG_STALL_MIN_S, 1.5 * _last_forward_s))


def simulate_async() -> bool:
    """Whether the CPU path simulates asynchronous lanes (``LAZYTRAIN_SIMULATE_ASYNC=1``)."""
    return env_flag(SIMULATE_ENV, "simulate asynchronous copies on the CPU", "copy inline")


def pin_host_memory(device: torch.device | str) -> bool:
    """Whether the executor page-locks its host buffers for ``device``: on CUDA, and on the CPU under the simulation,
    which then checks every lane copy's host side is pinned (`lazytrain_hf.pinned`)."""
    return torch.device(device).type == "cuda" or simulate_async()


def _sim_seed() -> int:
    raw = os.environ.get(SEED_ENV, "0")
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"{SEED_ENV}={raw!r} must be an integer seed.") from e


def _sim_max_delay() -> float:
    raw = os.environ.get(MAX_DELAY_ENV, "0.002")
    try:
        value = float(raw)
    except ValueError as e:
        raise ValueError(f"{MAX_DELAY_ENV}={raw!r} must be a number of seconds (e.g. 0.002).") from e
    if not 0 <= value <= 1:
        raise ValueError(f"{MAX_DELAY_ENV}={raw!r} must be in [0, 1] seconds.")
    return value


def _sim_stall_share(name: str) -> float:
    workers = [w.strip() for w in os.environ.get(STALL_WORKERS_ENV, "").split(",") if w.strip()]
    if workers and not any(name.startswith(w) for w in workers):
        return 0.0
    raw = os.environ.get(STALL_SHARE_ENV, str(_LONG_STALL_SHARE))
    try:
        value = float(raw)
    except ValueError as e:
        raise ValueError(f"{STALL_SHARE_ENV}={raw!r} must be a share of jobs in [0, 1] (e.g. 0.02).") from e
    if not 0 <= value <= 1:
        raise ValueError(f"{STALL_SHARE_ENV}={raw!r} must be a share of jobs in [0, 1] (e.g. 0.02).")
    return value


def poison_(t: torch.Tensor) -> None:
    """Fill ``t`` with a value no correct read can mistake for data (NaN bytes; -1 for integers)."""
    if t.numel() == 0:
        return
    if t.dtype == torch.uint8:
        t.fill_(0xFF)
    elif t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(-1)


def poison_after(t: torch.Tensor, ev: Any) -> None:
    """Poison ``t`` once the simulated copy ``ev`` completed (now when ``ev`` is None or a finished event)."""
    if isinstance(ev, SimEvent):
        ev.then(lambda: poison_(t))
    else:
        poison_(t)


def set_param_data(param: torch.Tensor, data: torch.Tensor, simulated: bool) -> None:
    """``param.data = data`` as a move between device and host. ``simulated``: the executor runs on simulated lanes,
    so the move resets the gradient accumulator as a device change does on CUDA (Note: [Moving a parameter's data
    drops its gradient accumulator])."""
    if simulated:
        param.data = torch.empty(0, dtype=torch.float32 if data.dtype == torch.float64 else torch.float64)
    param.data = data


class SimDelay:
    """Seeded random delays of one simulated worker (a lane, the optimizer's thread)."""

    def __init__(self, name: str):
        self.name = name
        self._rng = random.Random(f"{_sim_seed()}:{name}")
        self._max = _sim_max_delay()
        self._long_share = _sim_stall_share(name)
        self._lock = threading.Lock()
        self.long_stalls = 0  # how many long stalls this worker took (tests read it)

    def sleep(self) -> None:
        with self._lock:
            r = self._rng.random()
            if self._rng.random() < self._long_share:
                # Note: [Every background worker stalls for longer than a forward]
                d = long_stall_s()
                self.long_stalls += 1
            elif r < _NO_DELAY_SHARE:
                d = 0.0
            elif r < _NO_DELAY_SHARE + _STALL_SHARE:
                d = self._rng.uniform(self._max, 10 * self._max)
            else:
                d = self._rng.uniform(0.0, self._max)
        if d > 0:
            time.sleep(d)


class SimEvent:
    """Completion of one simulated job; the same calls as `torch.cuda.Event` that the engines use."""

    __slots__ = ("_done", "_error", "_callbacks", "_lock")

    def __init__(self, done: bool = False):
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        if done:
            self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise RuntimeError("a simulated asynchronous copy failed") from self._error

    def _finish(self, error: BaseException | None = None) -> None:
        # callbacks run before the event reads as done: a pool buffer is poisoned before `get` can hand it out
        self._error = error
        while True:
            with self._lock:
                callbacks, self._callbacks = self._callbacks, []
                if not callbacks:
                    self._done.set()
                    return
            for fn in callbacks:
                fn()

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the event completed (now, when it already has)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def __repr__(self) -> str:
        return f"SimEvent(done={self.query()})"


class _WeakSource:
    """Note: [Simulated copies hold their sources weakly]
    The CUDA caching allocator hands a freed block to the next allocation as soon as the host frees it: a copy
    queued on a side stream that reads a tensor the host dropped reads whatever was put there next, unless the
    tensor was marked with ``record_stream`` (`Lane.hold`) or kept by its owner until the copy's event. A simulated
    copy therefore keeps only a weak reference to its source's memory (the storage, with the view's geometry) and
    raises when that memory is gone by the time the copy runs; ``hold(t)`` keeps ``t`` until the lane's next copy
    ran. Returning a buffer to a pool is not a free: the pools carry the copy's event."""

    __slots__ = ("ref", "geometry", "dtype", "shape")

    def __init__(self, t: torch.Tensor):
        self.ref = weakref.ref(t.untyped_storage())
        self.geometry = (t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        self.dtype = t.dtype
        self.shape = tuple(t.shape)

    def get(self, lane: str) -> torch.Tensor:
        storage = self.ref()
        if storage is None:
            raise RuntimeError(
                f"lazytrain_hf: the source ({self.shape} {self.dtype}) of a copy on lane {lane!r} was freed before "
                "the copy ran; on CUDA the caching allocator may already have given its memory to another tensor. "
                "Keep it until the copy's event completed, or `Lane.hold` it (record_stream). See Note: [Simulated "
                "copies hold their sources weakly] in lazytrain_hf/streams.py."
            )
        offset, shape, stride = self.geometry
        return torch.empty(0, dtype=self.dtype).set_(storage, offset, shape, stride)


class SimLane:
    """A simulated stream: one worker thread running its jobs in issue order, each after a random delay."""

    def __init__(self, name: str):
        self.name = name
        self._delay = SimDelay(name)
        # the training thread (Note: [Backward runs on another thread]); set by `Lanes`
        self.compute_thread = threading.current_thread()
        self._q: queue.Queue[tuple[Callable[[], None], list[Any], SimEvent] | None] = queue.Queue()
        self._last = SimEvent(done=True)
        # which side of a copy is host memory, by the lane's name (Note: [Simulated copies need pinned host memory])
        self.direction = name.rsplit("-", 1)[-1]
        # per issuing thread, what `hold` kept since its last copy: released once its next copy ran (a lane may be
        # fed by two threads: the training thread and the optimizer's)
        self._holds: dict[int, list[torch.Tensor]] = {}
        self._thread = threading.Thread(target=self._run, name=f"lazytrain-sim-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, after, ev = item
            error = None
            try:
                for e in after:
                    e.synchronize()
                self._delay.sleep()
                fn()
            except BaseException as e:  # re-raised by whoever waits on the event
                error = e
            ev._finish(error)

    def submit(self, fn: Callable[[], None], after: Iterable[Any] = ()) -> SimEvent:
        ev = SimEvent()
        self._q.put((fn, [e for e in after if e is not None], ev))
        self._last = ev
        return ev

    def copy_all(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Iterable[Any] = (), after_compute: bool = False
    ) -> SimEvent:
        """Issue ``dst.copy_(src)`` for each pair, as one job; the event of the last. Note: [Simulated copies poison
        their destination]. ``after_compute`` needs no wait (Note: [Compute is synchronous in the simulation]), but
        only the compute stream's thread may ask for it (Note: [Backward runs on another thread]). The host side must
        be pinned (Note: [Simulated copies need pinned host memory]) and each source is held weakly (Note: [Simulated
        copies hold their sources weakly])."""
        if after_compute:
            check_compute_thread(self.compute_thread, f"lane {self.name}: copy(after_compute=True)")
        for dst, src in pairs:
            self._check_pinned(dst, src)
        for dst, _ in pairs:
            poison_(dst)
        sources = [_WeakSource(src) for _, src in pairs]
        dsts = [dst for dst, _ in pairs]
        held = self._holds.pop(threading.get_ident(), [])  # Note: [Simulated copies hold their sources weakly]

        def run() -> None:
            with torch.no_grad():
                for dst, src in zip(dsts, sources):
                    dst.copy_(src.get(self.name))
            held.clear()

        return self.submit(run, after)

    def _check_pinned(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Note: [Simulated copies need pinned host memory]
        On CUDA a ``non_blocking=True`` copy from or to pageable host memory goes through a driver staging buffer and
        may block the host: the copy is not asynchronous. The lane's host side (the source of an ``h2d`` copy, the
        destination of a ``d2h`` one) must therefore be pinned memory, registered or from the caching host
        allocator (`lazytrain_hf.pinned`); the simulation refuses anything else."""
        host = {"h2d": src, "d2h": dst}.get(self.direction)
        if host is None or pinned.REGISTRY.is_pinned(host):
            return
        raise pinned.PageableCopyError(
            f"lazytrain_hf: a {self.direction} copy on lane {self.name!r} of a {tuple(host.shape)} {host.dtype} host "
            "tensor in pageable memory; on CUDA it would run synchronously. Copy through a registered buffer "
            "(lazytrain_hf.pinned.PinnedBlock). See Note: [Simulated copies need pinned host memory] in "
            "lazytrain_hf/streams.py."
        )

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, after: Iterable[Any] = (), after_compute: bool = False
    ) -> Any:
        return self.copy_all([(dst, src)], after, after_compute)

    def hold(self, t: torch.Tensor) -> None:
        """Keep ``t``'s memory until the lane's next copy (the one issued for it) ran, as ``record_stream`` does on
        CUDA (Note: [Simulated copies hold their sources weakly])."""
        self._holds.setdefault(threading.get_ident(), []).append(t)

    def synchronize(self) -> None:
        self._last.synchronize()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)


class CudaLane:
    """A CUDA stream used as a copy lane."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy_all(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Iterable[Any] = (), after_compute: bool = False
    ) -> Any:
        """Issue ``dst.copy_(src, non_blocking=True)`` for each pair on the stream; the event after the last."""
        with torch.cuda.device(self.device):
            if after_compute:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for e in after:
                    if e is not None:
                        self.stream.wait_event(e)
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event(blocking=True)  # the host may wait on it: sleep, do not spin a core
                ev.record(self.stream)
        return ev

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, after: Iterable[Any] = (), after_compute: bool = False
    ) -> Any:
        return self.copy_all([(dst, src)], after, after_compute)

    def hold(self, t: torch.Tensor) -> None:
        """Tell the caching allocator that ``t`` is in use by this stream's queued copies."""
        t.record_stream(self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        pass


class Lanes:
    """The copy lanes of one engine and the compute side's view of their events.

    Args:
        device: the compute device.
        names: the lanes to create (e.g. ``("h2d", "d2h")``).
        owner: a name for the simulated threads (their delays are seeded by it).
    """

    def __init__(self, device: torch.device, names: Iterable[str], owner: str):
        self.device = torch.device(device)
        self.simulated = self.device.type != "cuda"
        self.compute_thread = threading.current_thread()  # Note: [Backward runs on another thread]
        self.lanes: dict[str, SimLane | CudaLane] = {
            n: SimLane(f"{owner}-{n}") if self.simulated else CudaLane(self.device) for n in names
        }

    def __getitem__(self, name: str) -> SimLane | CudaLane:
        return self.lanes[name]

    def compute_wait(self, ev: Any) -> None:
        """The compute side waits for ``ev`` before it next touches the copied data."""
        if ev is None:
            return
        if self.simulated:
            check_compute_thread(self.compute_thread, "compute_wait")
            ev.synchronize()
        else:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def compute_event(self) -> Any:
        """An event that completes once the compute side has run everything queued so far."""
        if self.simulated:
            check_compute_thread(self.compute_thread, "compute_event")
            return SimEvent(done=True)  # Note: [Compute is synchronous in the simulation]
        ev = torch.cuda.Event(blocking=True)  # a host wait on it sleeps instead of spinning a core
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def poison_after(self, t: torch.Tensor, ev: Any) -> None:
        """Simulation only: poison a buffer handed back to a pool once its last copy ``ev`` completed."""
        if self.simulated:
            poison_after(t, ev)

    def synchronize(self) -> None:
        for lane in self.lanes.values():
            lane.synchronize()

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()
        self.lanes.clear()


def lanes_for(device: torch.device, names: Iterable[str], owner: str) -> Lanes | None:
    """CUDA streams on a GPU, simulated lanes on the CPU under ``LAZYTRAIN_SIMULATE_ASYNC=1``, else ``None``
    (synchronous CPU copies)."""
    device = torch.device(device)
    if device.type == "cuda" or simulate_async():
        return Lanes(device, names, owner)
    return None
