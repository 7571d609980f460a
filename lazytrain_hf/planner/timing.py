"""The clock of the hardware probes and the layer timer: wall time by default; inside `timed_with(time.process_time)`
only this process's CPU time (with one thread on a shared machine, what its work costs whatever the other tenants
do)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

_clock: Callable[[], float] = time.perf_counter


def now() -> float:
    """The current reading of the probes' clock (seconds)."""
    return _clock()


@contextlib.contextmanager
def timed_with(timer: Callable[[], float] | None) -> Iterator[None]:
    """Time the probes inside the block with ``timer`` (None: `time.perf_counter`)."""
    global _clock
    prev, _clock = _clock, timer or time.perf_counter
    try:
        yield
    finally:
        _clock = prev


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` on the probes' clock."""
    times = []
    for _ in range(repeats):
        t0 = _clock()
        fn()
        times.append(_clock() - t0)
    times.sort()
    return times[len(times) // 2]
