"""Page-locked host memory: exact-size registered buffers, the caching host allocator, and their registry.

Every host buffer an asynchronous copy lane reads or writes (`lazytrain_hf.streams`) must be page-locked: a
``non_blocking=True`` copy from pageable memory is staged through a driver buffer and synchronises the host. Two kinds
of page-locked memory exist, and this module owns both, plus the bookkeeping the simulated asynchronous engine checks
CUDA's rules against:

- `PinnedBlock` / `pinned_empty`: an exact-size, page-aligned buffer (an anonymous mapping, returned to the OS when
  freed) page-locked in place with ``cudaHostRegister`` and unregistered before its memory can go (Note: [Unregister
  before free]). What the executor allocates: the host store, the activation pool, gradient and resident staging,
  the windows of the state on NVMe.
- `cached_empty`: a block of PyTorch's caching host allocator (``torch.empty(..., pin_memory=True)``), which rounds
  every block up to a power of two and never gives it back to the OS (Note: [The caching host allocator rounds and
  keeps]). Accounted at that size; the executor does not use it for anything sized by the plan.
- `REGISTRY` (`HostRegistry`): the process's registered ranges and caching-allocator blocks: `HostRegistry.is_pinned`
  (what the lanes check), `HostRegistry.pinned_bytes` (what the plan's pinned terms are compared with).

The registry is pure bookkeeping and runs wherever buffers are pinned: on CUDA next to the real calls, and on the
CPU under ``LAZYTRAIN_SIMULATE_ASYNC=1``, where the executor pins exactly what it pins on CUDA (`streams.pin_host_memory`)
and the registry alone stands for the driver. It imitates CUDA's rules with errors, so a breach fails a test on the
CPU instead of crashing (or silently slowing) a GPU run:

- registering a byte range that overlaps a registered one raises `HostRegisterError`
  (``cudaErrorHostMemoryAlreadyRegistered``, 712; two disjoint ranges on one page are allowed, as the driver does);
- a registered buffer whose memory is freed before it was unregistered is a violation (freed pages stay locked, and
  the next buffer glibc places at that address fails to register): recorded when the memory goes, raised by the next
  registry call and by `HostRegistry.check` (every test ends with it: ``tests/conftest.py``);
- a lane copy whose host side is not pinned raises `PageableCopyError` (``streams.SimLane``).

This module imports nothing from the package (it sits below `streams`).
"""

from __future__ import annotations

import bisect
import mmap
import threading
import weakref
from dataclasses import dataclass

import torch

PAGE = mmap.PAGESIZE
# cudaErrorHostMemoryAlreadyRegistered
ERR_ALREADY_REGISTERED = 712


class HostRegisterError(RuntimeError):
    """Registering a host range failed (on CUDA: the driver's error; in the simulation: an imitated one)."""


class PageableCopyError(RuntimeError):
    """An asynchronous lane copy was given pageable host memory (it would run synchronously on CUDA)."""


@dataclass
class Registration:
    """One registered host range ``[ptr, ptr + nbytes)``; ``what`` names its owner in error messages."""

    ptr: int
    nbytes: int
    what: str
    cuda: bool  # cudaHostRegister was called (a CUDA build with a device)
    active: bool = True
    freed: bool = False  # its memory went while it was still registered (a violation)

    @property
    def end(self) -> int:
        return self.ptr + self.nbytes


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """``(address, bytes)`` of the memory ``t``'s elements span (non-negative strides)."""
    if t.numel() == 0:
        return t.data_ptr(), 0
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), span * t.element_size()


class HostRegistry:
    """Registered host ranges and caching-host-allocator blocks of the process (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._starts: list[int] = []  # sorted starts of the registered (or stale) ranges
        self._ranges: dict[int, Registration] = {}
        self._violations: list[str] = []
        self.registered_bytes = 0  # bytes of the live registrations (exact, as requested)
        self.peak_registered_bytes = 0
        # Note: [The caching host allocator rounds and keeps]
        self._cached: dict[int, int] = {}  # storage address -> block size (power of two) of live cached blocks
        self._cache_free: dict[int, int] = {}  # block size -> free blocks kept by the allocator
        self.cached_bytes = 0  # bytes the caching host allocator holds (in use + free): never decreases

    # ------------------------------------------------------------------ registration
    def register(self, t: torch.Tensor, what: str) -> Registration:
        """Register the memory ``t`` spans, as ``cudaHostRegister`` does on CUDA. The registry does
        not keep ``t`` alive (CUDA does not): its owner must `unregister` before the memory goes."""
        ptr, nbytes = _byte_range(t)
        with self._lock:
            self._raise_violations()
            k = bisect.bisect_left(self._starts, ptr + nbytes)
            if k:
                prev = self._ranges[self._starts[k - 1]]
                if prev.end > ptr:
                    stale = " (a buffer freed while still registered)" if prev.freed else ""
                    raise HostRegisterError(
                        f"cudaHostRegister of {nbytes} bytes at {ptr:#x} for {what} failed with CUDA error "
                        f"{ERR_ALREADY_REGISTERED} (cudaErrorHostMemoryAlreadyRegistered): it overlaps the range of "
                        f"{prev.nbytes} bytes at {prev.ptr:#x} registered for {prev.what}{stale}. Unregister a buffer "
                        "before its memory is freed (Note: [Unregister before free] in lazytrain_hf/pinned.py)."
                    )
            cuda = torch.cuda.is_available()
            if cuda and nbytes:
                err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1)  # cudaHostRegisterPortable, as torch
                if int(err) != 0:
                    raise HostRegisterError(
                        f"cudaHostRegister of {nbytes} bytes for {what} failed (CUDA error {int(err)})."
                    )
            reg = Registration(ptr, nbytes, what, cuda)
            bisect.insort(self._starts, ptr)
            self._ranges[ptr] = reg
            self.registered_bytes += nbytes
            self.peak_registered_bytes = max(self.peak_registered_bytes, self.registered_bytes)
        ref = weakref.ref(reg)
        weakref.finalize(t.untyped_storage(), self._memory_freed, ref)
        return reg

    def unregister(self, reg: Registration) -> None:
        """Unregister ``reg`` (``cudaHostUnregister``); its memory may be freed afterwards."""
        with self._lock:
            if not reg.active:
                return
            reg.active = False
            if reg.cuda:
                torch.cuda.cudart().cudaHostUnregister(reg.ptr)
            self._drop(reg)
            self.registered_bytes -= reg.nbytes

    def _drop(self, reg: Registration) -> None:
        if self._ranges.get(reg.ptr) is reg:
            del self._ranges[reg.ptr]
            self._starts.pop(bisect.bisect_left(self._starts, reg.ptr))

    def _memory_freed(self, ref: weakref.ref) -> None:
        reg = ref()
        if reg is None or not reg.active:
            return
        with self._lock:
            # the pages stay locked (the range stays registered, stale): the next registration at this address fails
            reg.freed = True
            self._violations.append(
                f"the host buffer of {reg.nbytes} bytes at {reg.ptr:#x} registered for {reg.what} was freed while "
                "still registered (its pages stay locked, and a buffer placed at that address next fails to "
                "register with CUDA error 712); unregister it first (Note: [Unregister before free] in "
                "lazytrain_hf/pinned.py)."
            )

    def _raise_violations(self) -> None:
        if self._violations:
            msgs, self._violations = self._violations, []
            raise HostRegisterError("; ".join(msgs))

    def check(self, reset: bool = False) -> None:
        """Raise the violations recorded so far (a registered buffer freed before its unregistration). ``reset``:
        also forget the stale ranges such buffers left (a new test starts clean)."""
        with self._lock:
            if reset:
                for reg in [r for r in self._ranges.values() if r.freed]:
                    reg.active = False
                    self._drop(reg)
                    self.registered_bytes -= reg.nbytes
            self._raise_violations()

    # ------------------------------------------------------------------ caching host allocator
    def cached_block(self, t: torch.Tensor) -> int:
        """Account ``t`` as a block of the caching host allocator; returns the block's size (a power of two)."""
        _, nbytes = _byte_range(t)
        size = 1 << max(0, int(nbytes - 1).bit_length())
        ptr = t.untyped_storage().data_ptr()
        with self._lock:
            if self._cache_free.get(size):
                self._cache_free[size] -= 1  # a freed block of this size is reused
            else:
                self.cached_bytes += size  # a new block; never returned to the OS
            self._cached[ptr] = size
        weakref.finalize(t.untyped_storage(), self._cached_freed, ptr, size)
        return size

    def _cached_freed(self, ptr: int, size: int) -> None:
        with self._lock:
            if self._cached.get(ptr) == size:
                del self._cached[ptr]
            self._cache_free[size] = self._cache_free.get(size, 0) + 1

    # ------------------------------------------------------------------ queries
    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether all of ``t``'s memory is page-locked: inside one live registered range, or a caching-host-allocator
        block. An empty tensor moves nothing and counts as pinned."""
        if t.numel() == 0:
            return True
        ptr, nbytes = _byte_range(t)
        with self._lock:
            if t.untyped_storage().data_ptr() in self._cached:
                return True
            k = bisect.bisect_right(self._starts, ptr)
            if not k:
                return False
            reg = self._ranges[self._starts[k - 1]]
            return reg.active and not reg.freed and reg.ptr <= ptr and ptr + nbytes <= reg.end

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes the process holds: live registrations (exact) and the caching host allocator's blocks
        (power-of-two sizes, in use or kept)."""
        return self.registered_bytes + self.cached_bytes

    def __repr__(self) -> str:
        return (
            f"HostRegistry(registered={self.registered_bytes}B in {len(self._ranges)} ranges, "
            f"cached={self.cached_bytes}B)"
        )


REGISTRY = HostRegistry()


def _mapped(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes of an anonymous mapping (page-aligned; unmapped once the last view is gone)."""
    m = mmap.mmap(-1, max(PAGE, -(-nbytes // PAGE) * PAGE))
    return torch.frombuffer(m, dtype=torch.uint8)[:nbytes]


# Note: [Unregister before free]
#     ``cudaHostRegister`` does not own the memory it locks: a registered buffer freed before ``cudaHostUnregister``
#     leaves its pages locked, and glibc hands the same address to the next allocation of that size, whose
#     registration then fails (712). A `PinnedBlock` therefore holds its buffer and its registration together, and
#     `PinnedBlock.release` (also run when the block is collected) unregisters before it drops the buffer: views handed
#     out may keep the memory alive after that, but then as pageable memory, which the simulated lanes refuse.
class PinnedBlock:
    """An exact-size host buffer of ``nbytes`` bytes at a page-aligned address, zero-filled, registered (page-locked)
    when ``pin`` (Note: [Unregister before free]). ``tensor`` is the uint8 buffer; ``what`` names it in errors."""

    def __init__(self, nbytes: int, pin: bool, what: str = "a host buffer"):
        self.nbytes = int(nbytes)
        self.tensor: torch.Tensor | None = _mapped(self.nbytes)
        self.registration = REGISTRY.register(self.tensor, what) if pin and self.nbytes else None

    @property
    def pinned(self) -> bool:
        return self.registration is not None and self.registration.active

    def release(self) -> None:
        """Unregister, then drop the buffer (it is freed once no view of it is left)."""
        if self.registration is not None:
            REGISTRY.unregister(self.registration)
            self.registration = None
        self.tensor = None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"PinnedBlock(nbytes={self.nbytes}, pinned={self.pinned})"


def pinned_empty(n: int, dtype: torch.dtype, pin: bool, keep: list, what: str = "a host buffer") -> torch.Tensor:
    """A zero-filled host tensor of exactly ``n`` elements of ``dtype`` at a page-aligned address, registered when
    ``pin``; its `PinnedBlock` is appended to ``keep`` (whose owner releases it: Note: [Unregister before free])."""
    block = PinnedBlock(n * dtype.itemsize, pin, what)
    keep.append(block)
    return block.tensor.view(dtype)


# Note: [The caching host allocator rounds and keeps]
#     ``torch.empty(..., pin_memory=True)`` takes its block from PyTorch's CachingHostAllocator, which rounds every
#     request up to a power of two and keeps freed blocks for reuse instead of returning them to the OS
#     (`CachingHostAllocator.h`): a 300 MiB buffer holds 512 MiB of page-locked memory for the life of the process.
#     The registry accounts such blocks at that size and never gives the bytes back.
def cached_empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A pinned tensor of ``n`` elements from the caching host allocator (CUDA), or its imitation on the CPU; accounted
    at its power-of-two block size (Note: [The caching host allocator rounds and keeps])."""
    t = torch.empty(n, dtype=dtype, pin_memory=torch.cuda.is_available())
    REGISTRY.cached_block(t)
    return t
