"""Host windows of the state on NVMe that copy lanes read and write: registered, exact-size, reused.

A unit whose state is on NVMe (`lazytrain_hf.streaming.nvmestate`) is fetched through a host window (its compute copy
read from the file, then copied to the device slot on the H2D lane) and receives its gradients in one (the D2H copy
of a fresh gradient lands there, the window is written back to the file). Both copies are asynchronous only from
page-locked memory (Note: [Simulated copies need pinned host memory] in lazytrain_hf/streams.py), so the windows are
`PinnedBlock`s: registered once at their exact size (rounded up to `IO_ALIGN` for ``O_DIRECT``), page-aligned, and
reused across fetches and steps instead of being registered per use. Owns `WindowPool`; knows nothing of units.
"""

from __future__ import annotations

import threading

from .. import pinned

# Free windows kept per size (fetch windows and gradient windows have sizes of their own): as many as the host
# footprint charges of each (planner/hostmem.py: STATE_FETCH_WINDOWS, STATE_GRAD_WINDOWS); a window beyond that is
# released (unregistered, then freed).
KEEP_FREE = 2


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
