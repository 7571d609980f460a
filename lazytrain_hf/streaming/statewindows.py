"""Host windows of the state on NVMe that copy lanes read and write: registered, exact-size, reused.

A unit whose state is on NVMe (`lazytrain_hf.streaming.nvmestate`) is fetched through a host window (its compute copy
read from the file, then copied to the device slot on the H2D lane) and receives its gradients in one (the D2H copy
of a fresh gradient lands there, the window is written back to the file). Both copies are asynchronous only from
page-locked memory (Note: [Simulated copies need pinned host memory] in lazytrain_hf/streams.py), so the windows are
`PinnedBlock`s: registered once at their exact size (rounded up to `IO_ALIGN` for ``O_DIRECT``), page-aligned, and
reused across fetches and steps instead of being registered per use. Owns `WindowPool` (gradient windows) and
`FetchWindows` (the bounded set of fetch windows, each handed out again only once the copy that read it completed);
knows nothing of units.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import Any

from .. import pinned
from ..planner.hostmem import STATE_FETCH_WINDOWS, STATE_GRAD_WINDOWS

# Free gradient windows kept per size: as many as the host footprint charges (planner/hostmem.py:
# STATE_GRAD_WINDOWS); a window beyond that is released (unregistered, then freed).
KEEP_FREE = STATE_GRAD_WINDOWS


class WindowPool:
    """Registered host windows by size (see the module docstring).

    Args:
        pin: register the windows (on CUDA, and on the CPU under the simulation: `streams.pin_host_memory`).
        align: sizes are rounded up to a multiple of this (``O_DIRECT`` transfers whole blocks).
    """

    def __init__(self, pin: bool, align: int):
        self.pin = bool(pin)
        self.align = int(align)
        self._free: dict[int, list[pinned.PinnedBlock]] = {}
        self._lock = threading.Lock()
        self.allocated_bytes = 0  # bytes of the windows this pool owns (free + handed out)

    def get(self, nbytes: int) -> pinned.PinnedBlock:
        """A window of at least ``nbytes`` bytes (a multiple of ``align``); its ``tensor`` is the uint8 buffer.
        Its content is whatever its last user left."""
        size = max(self.align, -(-int(nbytes) // self.align) * self.align)
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
            self.allocated_bytes += size
        return pinned.PinnedBlock(size, self.pin, "a window of the state on NVMe")

    def put(self, block: pinned.PinnedBlock) -> None:
        """Hand back a window from `get` once nothing reads or writes it any more."""
        with self._lock:
            free = self._free.setdefault(block.nbytes, [])
            if len(free) < KEEP_FREE:
                free.append(block)
                return
            self.allocated_bytes -= block.nbytes
        block.release()

    def clear(self) -> None:
        """Release every free window."""
        with self._lock:
            blocks = [b for v in self._free.values() for b in v]
            self._free.clear()
            self.allocated_bytes -= sum(b.nbytes for b in blocks)
        for b in blocks:
            b.release()

    def __repr__(self) -> str:
        return f"WindowPool(pin={self.pin}, allocated={self.allocated_bytes}B)"


class FetchWindows:
    """At most ``count`` registered windows that weight fetches read a unit's compute copy into (the host footprint
    charges `STATE_FETCH_WINDOWS` of them, planner/hostmem.py), each handed out again only once the H2D copy that
    read it completed (Note: [A fetch from NVMe is read off the step's threads] in nvmestate.py).

    `get` and `put` are called by the state's reader thread: when every window is in flight, `get` waits there for
    the oldest copy (a background wait: the threads that drive a step never wait for a window).

    Args:
        pin, align: as `WindowPool`'s.
        count: windows at most, in flight or free.
    """

    def __init__(self, pin: bool, align: int, count: int = STATE_FETCH_WINDOWS):
        if count < 1:
            raise ValueError(f"count={count}: a fetch needs at least one window.")
        self.pin = bool(pin)
        self.align = int(align)
        self.count = int(count)
        self._free: list[pinned.PinnedBlock] = []
        self._busy: deque[tuple[Any, pinned.PinnedBlock]] = deque()  # (event of the copy reading it, window)
        self._lock = threading.Lock()
        self._allocated = 0  # windows this set owns: free, in flight, or handed out by `get` and not `put` yet
        self.allocated_bytes = 0
        self.most_allocated = 0  # the most windows allocated at once (tests read it)

    def _reap(self) -> None:
        while self._busy and (self._busy[0][0] is None or self._busy[0][0].query()):
            self._free.append(self._busy.popleft()[1])

    def get(self, nbytes: int) -> pinned.PinnedBlock:
        """A window of at least ``nbytes`` bytes (a multiple of ``align``) that no copy reads any more; hand it back
        with `put`. Its content is whatever its last user left."""
        size = max(self.align, -(-int(nbytes) // self.align) * self.align)
        while True:
            with self._lock:
                self._reap()
                hit = next((k for k, b in enumerate(self._free) if b.nbytes == size), None)
                if hit is not None:
                    return self._free.pop(hit)
                gone = self._free.pop(0) if self._free and self._allocated >= self.count else None
                if gone is not None:  # a free window of another size makes room for this one
                    self._allocated -= 1
                    self.allocated_bytes -= gone.nbytes
                oldest = None
                if self._allocated < self.count:
                    self._allocated += 1
                    self.allocated_bytes += size
                    self.most_allocated = max(self.most_allocated, self._allocated)
                elif self._busy:
                    oldest = self._busy[0][0]
                else:
                    raise RuntimeError(f"every one of the {self.count} fetch windows is handed out and none was put.")
            if gone is not None:
                gone.release()  # unregistered, then freed (Note: [Unregister before free] in lazytrain_hf/pinned.py)
            if oldest is None:
                try:
                    return pinned.PinnedBlock(size, self.pin, "a fetch window of the state on NVMe")
                except BaseException:
                    with self._lock:
                        self._allocated -= 1
                        self.allocated_bytes -= size
                    raise
            with contextlib.suppress(Exception):  # a failed copy's error reaches whoever waits for its fetch
                oldest.synchronize()

    def put(self, block: pinned.PinnedBlock, event: Any) -> None:
        """Hand back a window from `get`; ``event``: the copy that reads it (None: nothing does)."""
        with self._lock:
            self._busy.append((event, block))

    def clear(self) -> None:
        """Wait for the copies that read windows and release every window (none may be handed out)."""
        with self._lock:
            busy, self._busy = list(self._busy), deque()
            blocks, self._free = list(self._free), []
        for ev, block in busy:
            if ev is not None:
                with contextlib.suppress(Exception):
                    ev.synchronize()
            blocks.append(block)
        with self._lock:
            self._allocated -= len(blocks)
            self.allocated_bytes -= sum(b.nbytes for b in blocks)
        for b in blocks:
            b.release()

    def __repr__(self) -> str:
        return f"FetchWindows(pin={self.pin}, count={self.count}, allocated={self.allocated_bytes}B)"
