"""Threads of the executor as CUDA sees them: which thread stands for the compute stream, and the simulation's
autograd thread.

Note: [Backward runs on another thread]
    On CUDA the autograd engine runs backward nodes, and with them every backward hook of the executor, on its
    device thread, whose current stream is set to the forward's stream; a thread's own current stream is otherwise
    the default stream. With ``LAZYTRAIN_SIMULATE_AUTOGRAD_THREAD=1`` (a test profile of the simulation) every
    ``torch.autograd.backward`` runs on one worker thread (`install_autograd_thread`), so backward hooks never see
    the training thread's thread-local state. Only the thread that created the lanes (the training thread) and that
    autograd thread stand for the compute stream: ``compute_event``, ``compute_wait`` and ``after_compute`` called
    from any other thread (the optimizer's, a worker's) raise, since on CUDA they would order against that thread's
    default stream instead of the compute stream. Host synchronisations are counted on every thread that drives a
    step (training and autograd); a background worker marks itself with `background_worker`. Tests:
    ``tests/test_cuda_semantics_grad.py::test_backward_on_the_autograd_thread_counts_its_host_syncs`` and
    ``::test_optimizer_thread_orders_uploads_after_the_training_threads_compute``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

AUTOGRAD_THREAD_ENV = "LAZYTRAIN_SIMULATE_AUTOGRAD_THREAD"


def env_flag(name: str, on: str, off: str) -> bool:
    """The on/off environment variable ``name`` (unset, ``0``, ``false``, ``no``, ``off``: off; ``1``, ``true``,
    ``yes``, ``on``: on); anything else is refused, saying what ``1`` (``on``) and ``0`` (``off``) do."""
    value = os.environ.get(name, "0").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={value!r}: use 1 to {on} or 0 to {off}.")


def simulate_autograd_thread() -> bool:
    """Whether the simulation runs backward on a thread of its own (``LAZYTRAIN_SIMULATE_AUTOGRAD_THREAD=1``; Note:
    [Backward runs on another thread])."""
    return env_flag(AUTOGRAD_THREAD_ENV, "run backward on a simulated autograd thread", "run it on the calling thread")


_local = threading.local()


@contextlib.contextmanager
def background_worker() -> Iterator[None]:
    """Mark the calling thread as a background worker for the block: its host waits do not stall the step, so they
    are not counted as the step's host synchronisations (`on_step_path`)."""
    prev = getattr(_local, "background", False)
    _local.background = True
    try:
        yield
    finally:
        _local.background = prev


def on_step_path() -> bool:
    """Whether a host wait on this thread stalls the step: every thread but a marked background worker (the
    training thread, and the autograd thread that runs its backward). Note: [Backward runs on another thread]."""
    return not getattr(_local, "background", False)


class _AutogradThread:
    """The simulated autograd device thread: runs ``torch.autograd.backward`` calls for the threads that make them.

    Note: [Backward runs on another thread]. A backward started from inside a backward (on this thread) runs in
    place, as the autograd engine runs a reentrant backward."""

    def __init__(self, backward: Callable[..., Any]):
        self.backward = backward
        self._q: queue.Queue[tuple[tuple, dict, threading.Event, list] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="lazytrain-sim-autograd", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            args, kwargs, done, box = job
            try:
                box.append((True, self.backward(*args, **kwargs)))
            except BaseException as e:  # re-raised on the calling thread
                box.append((False, e))
            done.set()
            # the job's tensors (the loss, and through its graph the parameters) must not outlive the backward while
            # this thread waits for the next one: autograd keeps no reference to them, and `remove()` swaps
            # parameters, which a stray reference refuses (tests/test_state_nvme.py::test_units_from_disk_stay_on_disk)
            del job, args, kwargs, done, box

    def call(self, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is self.thread:
            return self.backward(*args, **kwargs)
        done, box = threading.Event(), []
        self._q.put((args, kwargs, done, box))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self._q.put(None)
        self.thread.join(timeout=10)


_autograd: _AutogradThread | None = None
_autograd_users = 0
_autograd_lock = threading.Lock()


def install_autograd_thread() -> None:
    """Route every ``torch.autograd.backward`` (``Tensor.backward`` calls it) through the simulated autograd thread
    until the matching `uninstall_autograd_thread`. Note: [Backward runs on another thread]."""
    global _autograd, _autograd_users
    with _autograd_lock:
        _autograd_users += 1
        if _autograd is None:
            _autograd = _AutogradThread(torch.autograd.backward)
            torch.autograd.backward = _autograd.call


def uninstall_autograd_thread() -> None:
    global _autograd, _autograd_users
    with _autograd_lock:
        _autograd_users = max(0, _autograd_users - 1)
        if _autograd_users == 0 and _autograd is not None:
            torch.autograd.backward = _autograd.backward
            _autograd.stop()
            _autograd = None


def check_compute_thread(owner: threading.Thread, what: str) -> None:
    """Simulation: refuse a compute-stream operation from a thread whose current stream would not be the compute
    stream on CUDA (Note: [Backward runs on another thread])."""
    cur = threading.current_thread()
    if cur is owner or (_autograd is not None and cur is _autograd.thread):
        return
    raise RuntimeError(
        f"lazytrain_hf simulation: {what} on thread {cur.name!r}, whose current CUDA stream is the default stream, "
        f"not the compute stream of the training thread {owner.name!r}. Record an event on the training thread "
        "(Lanes.compute_event) and pass it as after=(event,) instead. See Note: [Backward runs on another thread] "
        "in lazytrain_hf/threads.py."
    )
