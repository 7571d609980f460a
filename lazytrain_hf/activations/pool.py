"""The host buffer pool of the pinned-CPU tier (and of NVMe staging): byte buffers keyed by rounded size.

Owns `HostBufferPool`. Knows nothing of layers or plans; the only asynchrony it sees is the event a buffer carries
(Note: [Pool buffers carry their last copy]).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .. import pinned, streams
from ..units import format_bytes

# Note: [Pool buffers are keyed by rounded size]
# Activation shapes repeat every step, so a pool keyed by (rounded) byte size reaches a fixed point after the first
# step: later steps allocate nothing. Rounding to 512 bytes lets tensors of nearly the same size share buffers.
POOL_GRANULE = 512


class HostBufferPool:
    """Host byte buffers keyed by rounded size, reused across steps; pinned when ``pin_memory``.

    Args:
        pin_memory: allocate page-locked buffers (needs CUDA), so device copies can run asynchronously.

    Each buffer may carry the CUDA event of the last asynchronous copy that reads or writes it;
    `get` waits for that event before handing the buffer out again (Note: [Pool buffers carry their last copy]).
    """

    def __init__(self, pin_memory: bool = False, poison: bool = False) -> None:
        # pinned buffers are registered at their exact (bucket) size, not taken from the caching host allocator
        self.pin_memory = pin_memory
        self.poison = poison  # simulated asynchronous engine: buffers are poisoned when handed back
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self._blocks: dict[int, pinned.PinnedBlock] = {}  # address -> the registered block of a pinned buffer
        self._lock = threading.Lock()
        self.allocated_bytes = 0  # bytes of all buffers this pool owns (free + handed out)
        self.num_allocations = 0  # buffers ever allocated: stops growing once the pool reaches its fixed point

    @staticmethod
    def bucket(nbytes: int) -> int:
        return max(POOL_GRANULE, -(-nbytes // POOL_GRANULE) * POOL_GRANULE)

    def get(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` bytes (exactly its bucket size)."""
        size = self.bucket(nbytes)
        with self._lock:
            free = self._free.get(size)
            entry = free.pop() if free else None
        if entry is not None:
            buf, event = entry
            # Note: [Pool buffers carry their last copy]
            # A buffer returned while an asynchronous copy still reads or writes it is only reused after that copy.
            if event is not None:
                event.synchronize()
            return buf
        if self.pin_memory:
            # exact-size and registered: Note: [Pinned blocks are registered, not cached] in streaming/store.py
            block = pinned.PinnedBlock(size, True, "a pooled activation buffer")
            buf = block.tensor
        else:
            block, buf = None, torch.empty(size, dtype=torch.uint8)
        with self._lock:
            if block is not None:
                self._blocks[buf.data_ptr()] = block
            self.allocated_bytes += size
            self.num_allocations += 1
        return buf

    def put(self, buf: torch.Tensor, event: Any = None) -> None:
        """Return ``buf``; ``event`` (CUDA) is the last copy that uses it (See Note: [Pool buffers carry ...])."""
        if self.poison:
            streams.poison_after(buf, event)  # Note: [Simulated copies poison their destination]
        with self._lock:
            self._free.setdefault(buf.numel(), []).append((buf, event))

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for v in self._free.values() for b, _ in v)

    def clear(self) -> None:
        """Free every cached buffer (buffers handed out stay valid and are simply dropped when put back later)."""
        with self._lock:
            freed = sum(b.numel() for v in self._free.values() for b, _ in v)
            blocks = []
            for v in self._free.values():
                for b, ev in v:
                    if ev is not None:
                        ev.synchronize()
                    if b.data_ptr() in self._blocks:
                        blocks.append(self._blocks.pop(b.data_ptr()))
            self._free.clear()
            self.allocated_bytes -= freed
        for block in blocks:
            block.release()  # unregistered, then freed

    def __repr__(self) -> str:
        return (
            f"HostBufferPool(pin_memory={self.pin_memory}, allocated={format_bytes(self.allocated_bytes)}, "
            f"cached={format_bytes(self.cached_bytes)}, allocations={self.num_allocations})"
        )
