"""Activation placement engine: keep / offload to (pinned) CPU / offload to NVMe / recompute, per layer, as planned.

The streaming executor calls `ActivationEngine.begin_layer` from the forward pre-hook of every decoder layer and
`ActivationEngine.end_layer` from its forward post-hook. In between, every tensor autograd saves for the layer's
backward goes through `torch.autograd.graph.saved_tensors_hooks` installed by the engine and is routed by the layer's
`LayerPlan`:

- ``keep``: the tensor stays where it is (on the compute device);
- ``offload_cpu``: copied into a reusable host buffer (pinned when the device is CUDA; the device-to-host copy runs
  on a side stream) and released on the device; reloaded before the layer's backward (`ActivationEngine.prefetch`)
  or, at the latest, when autograd unpacks it;
- ``offload_nvme``: copied into a host staging buffer and written to a spill file by a background writer; read back
  by a background reader when the reload is issued;
- ``recompute``: nothing is saved but the layer input (which itself goes to ``LayerPlan.input_tier``); the first
  unpack in backward re-runs ``module.forward`` with the RNG and autocast state of the original forward under
  recording hooks and serves the recomputed tensors by index: the non-reentrant mechanism of
  ``torch.utils.checkpoint(use_reentrant=False)``.
- block checkpointing (``Plan.checkpoint_every = K > 1``, every layer ``recompute`` with its input on the gpu tier):
  only the input of the first layer of each block ``[s, s + K)`` (``s = 0, K, 2K, ...``; the last block may be
  shorter) is saved, on the device; the other layers of the block save nothing at all. At the start of the block's
  backward (`ActivationEngine.begin_backward` of its top layer, or the first unpack of any of its tensors) the whole
  block is recomputed layer by layer from that input, each layer with its own RNG / autocast state and keyword
  arguments, its weights bound for the recomputation by the executor (`RecomputeWeights`) and released afterwards;
  every layer's recomputed tensors are served to its backward by index (See Note: [Block recomputation]).

Weights are never offloaded: a streamed weight is handed to the executor's `ParamPacker` (a small reference is stored
and the view is rebuilt on the layer's current device slot at unpack); without a packer, tensors whose storage is a
parameter of the layer are kept by reference. Shared inputs of the layer (rotary cos/sin, masks, position ids) are
kept by reference too.

On a machine without a GPU the "device" is the CPU: the gpu tier keeps tensors as they are, the cpu tier copies into
the host buffer pool, the nvme tier writes real files, so every path runs in CPU tests. Saved tensors come back with
the same dtype, shape, strides, storage-offset alignment and values, so gradients are bit-identical to plain autograd
under any policy vector.

`attach_standalone` installs the hooks an executor would on an ordinary (un-streamed) HF model; the tests use it to
compare against plain autograd.

The Notes below and the tests that exercise them (every test runs under the simulated asynchronous engine of
`lazytrain_hf.streams` unless marked ``sync_engine``, so a missing wait shows as NaN or a wrong gradient):

| Note | tests |
| --- | --- |
| [D2H waits for the producer], [Offload source stays alive until its copy completes] | ``test_activations.py::test_policy_vector_bit_exact``, ``test_activations_property.py``, ``test_plan_space.py`` |
| [Reload waits for the offload copy], [H2D waits for the block's previous users] | the same (a reload issued before its offload copy landed reads the poisoned host buffer) |
| [Pool buffers carry their last copy] | ``test_policy_vector_bit_exact``, ``test_host_pool_does_not_grow_after_first_step`` (a buffer reused before its copy finished is poisoned) |
| [Saved tensors are restored with their layout] | ``test_saved_tensor_round_trip_layout`` |
| [Saved tensors are not written in place while their copy runs] | ``test_modified_storage_is_copied_again`` (synchronous engine) |
| [Pool buffers are keyed by rounded size] | ``test_host_pool_buckets_and_reuse``, ``test_host_pool_does_not_grow_after_first_step`` |
| [Offloaded storages are copied once] | ``test_views_of_one_storage_are_copied_once`` |
| [Weights are never offloaded] | ``test_param_packer_references_weights`` |
| [Spill files never outlive the process] | ``test_spill_files_*``, ``test_activations_process.py`` |
| [Recompute replays RNG and autocast state] | ``test_recompute_with_dropout_matches_keep``, ``test_recompute_leaves_training_rng_and_module_hooks_alone`` |
| [Recompute serves tensors by index, per backward], [Block recomputation] | ``test_retain_graph_second_backward``, ``test_block_recompute.py``, ``test_plan_space.py`` (``checkpoint_every``) |
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
import re
import shutil
import socket
import tempfile
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from . import streams
from .planner.plan import Plan
from .units import format_bytes

__all__ = [
    "ActivationEngine",
    "ActivationSpillError",
    "HostBufferPool",
    "ParamPacker",
    "RecomputeWeights",
    "StandaloneHandle",
    "attach_standalone",
]

# Note: [Saved tensors are restored with their layout]
# A saved tensor comes back with the same dtype, shape and strides, and with the same storage offset modulo 64 bytes
# (the alignment phase that vectorised kernels and BLAS blocking may depend on), so the backward kernels run exactly
# the code paths they run under plain autograd and gradients are bit-identical. Only the elements the view covers
# are copied ("compact" copy, in the view's own dimension order); broadcast (stride-0) dimensions are copied once
# and re-expanded. Gapped views (e.g. the halves of a chunked gate_up projection) are restored into a fresh storage
# with the same strides, i.e. the same span the original base storage had: never more device memory than the
# original. Views whose elements overlap in memory cannot be restored by a copy and stay on the device.
_ALIGN_BYTES = 64

# Note: [Saved tensors are not written in place while their copy runs]
# An offload copy reads the saved tensor asynchronously (a side stream on CUDA, a lane in the simulated engine): a
# layer that writes a saved tensor in place after saving it (autograd's own version check is off under saved-tensor
# hooks) would race that copy. Models do not (plain autograd refuses it at backward); the synchronous CPU engine still
# serves such a tensor correctly, copying it again when it is saved after the write
# (`test_modified_storage_is_copied_again`).

# Note: [Pool buffers are keyed by rounded size]
# Activation shapes repeat every step, so a pool keyed by (rounded) byte size reaches a fixed point after the first
# step: later steps allocate nothing. Rounding to 512 bytes lets tensors of nearly the same size share buffers.
_POOL_GRANULE = 512

# Keyword arguments that must not be replayed by a recomputation: a KV cache would be extended a second time.
# In training the cache HF creates is empty before the layer runs, so the layer computes the same tensors without it.
_NO_REPLAY_KWARGS: dict[str, Any] = {"cache": None, "past_key_values": None, "layer_past": None, "use_cache": False}

_SPILL_PREFIX = "lazytrain-act_"
_SPILL_RE = re.compile(r"^lazytrain-act_(?P<host>[0-9a-f]{8})_(?P<pid>\d+)_(?P<start>\d+)_")

# Indirection so tests can inject I/O failures (ENOSPC) without touching the `os` module other code uses.
_pwrite = os.pwrite
_preadv = os.preadv


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


class ActivationSpillError(OSError):
    """Writing activations to the NVMe spill directory failed (e.g. ENOSPC). The spill files are removed."""


# ---------------------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class _Layout:
    """How to copy a strided tensor out compactly and restore it with the same strides (see the Note above)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    narrow: tuple[int, ...]  # size with broadcast (stride-0) dimensions reduced to 1: what is actually copied
    compact: tuple[int, ...]  # dense strides in the view's own dimension order: the host / file layout
    numel: int  # elements copied (prod(narrow))
    span: int  # elements the restored storage needs after `pad`
    pad: int  # storage offset of the restored view, in elements: keeps the 64-byte alignment phase
    dense: bool  # restored memory image == compact image (no gaps), so bytes can land in place

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @staticmethod
    def of(t: torch.Tensor) -> _Layout | None:
        """The layout of ``t``, or ``None`` when its elements overlap in memory (cannot be restored by a copy)."""
        size, stride = tuple(t.shape), tuple(t.stride())
        narrow = tuple(1 if st == 0 else s for s, st in zip(size, stride))
        compact = [1] * len(size)
        extent, acc = 0, 1
        for d in sorted((d for d in range(len(size)) if narrow[d] > 1), key=lambda d: stride[d]):
            if stride[d] <= extent:
                return None
            compact[d] = acc
            acc *= narrow[d]
            extent += (narrow[d] - 1) * stride[d]
        numel = math.prod(narrow)
        itemsize = t.element_size()
        align = _ALIGN_BYTES // itemsize if _ALIGN_BYTES % itemsize == 0 else 1
        return _Layout(
            size=size,
            stride=stride,
            dtype=t.dtype,
            narrow=narrow,
            compact=tuple(compact),
            numel=numel,
            span=extent + 1,
            pad=t.storage_offset() % align,
            dense=extent + 1 == numel,
        )

    def source(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with its broadcast dimensions narrowed to one element (the elements to copy)."""
        return t if self.narrow == self.size else t.as_strided(self.narrow, self.stride)

    def host_view(self, buf: torch.Tensor) -> torch.Tensor:
        """The compact view of a byte buffer that holds this tensor's elements."""
        return buf[: self.nbytes].view(self.dtype).as_strided(self.narrow, self.compact)

    def empty(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fresh storage on ``device``: ``(storage, narrowed view to copy into, final view to return)``."""
        storage = torch.empty(self.pad + self.span, dtype=self.dtype, device=device)
        return (
            storage,
            storage.as_strided(self.narrow, self.stride, self.pad),
            storage.as_strided(self.size, self.stride, self.pad),
        )

    def landing_bytes(self, storage: torch.Tensor) -> torch.Tensor:
        """For a dense layout: the bytes of ``storage`` the compact image lands in unchanged."""
        start = self.pad * self.itemsize
        return storage.view(torch.uint8)[start : start + self.nbytes]


def _plain_strided(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and type(t) in (torch.Tensor, nn.Parameter) and not t.is_meta


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _fingerprint(t: torch.Tensor) -> tuple | None:
    """Identity of a tensor's data: storage, offset, shape, strides, dtype and version (views share the version
    counter, so an in-place change after the fingerprint was taken is seen). None for tensors without a storage."""
    if not _plain_strided(t):
        return None
    return (_storage_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)


def _tensors_in(obj: Any, out: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    """Tensors inside (nested) tuples, lists and dicts: the shared inputs of a layer call."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 4 and isinstance(obj, list | tuple):
        for o in obj:
            _tensors_in(o, out, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for o in obj.values():
            _tensors_in(o, out, depth + 1)
    return out


# ---------------------------------------------------------------------------------------------------------- pools
class HostBufferPool:
    """Host byte buffers keyed by rounded size, reused across steps; pinned when ``pin_memory``.

    Args:
        pin_memory: allocate page-locked buffers (needs CUDA), so device copies can run asynchronously.

    Each buffer may carry the CUDA event of the last asynchronous copy that reads or writes it;
    `get` waits for that event before handing the buffer out again (Note: [Pool buffers carry their last copy]).
    """

    def __init__(self, pin_memory: bool = False, poison: bool = False) -> None:
        self.pin_memory = pin_memory
        self.poison = poison  # simulated asynchronous engine: buffers are poisoned when handed back
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self._lock = threading.Lock()
        self.allocated_bytes = 0  # bytes of all buffers this pool owns (free + handed out)
        self.num_allocations = 0  # buffers ever allocated: stops growing once the pool reaches its fixed point

    @staticmethod
    def bucket(nbytes: int) -> int:
        return max(_POOL_GRANULE, -(-nbytes // _POOL_GRANULE) * _POOL_GRANULE)

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
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
        with self._lock:
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
            for v in self._free.values():
                for _, ev in v:
                    if ev is not None:
                        ev.synchronize()
            self._free.clear()
            self.allocated_bytes -= freed

    def __repr__(self) -> str:
        return (
            f"HostBufferPool(pin_memory={self.pin_memory}, allocated={format_bytes(self.allocated_bytes)}, "
            f"cached={format_bytes(self.cached_bytes)}, allocations={self.num_allocations})"
        )


class _Accountant:
    """Bytes of saved activations per tier, with peaks. Device bytes count unique storages (refcounted)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._storages: dict[int, list[int]] = {}  # storage ptr -> [refcount, nbytes]
        self.cur = {"gpu": 0, "cpu": 0, "nvme": 0}
        self.peak = {"gpu": 0, "cpu": 0, "nvme": 0}

    def add_storage(self, t: torch.Tensor) -> tuple[int, int]:
        """Count ``t``'s storage once; returns ``(key, bytes newly counted)``."""
        key = _storage_key(t)
        with self.lock:
            rec = self._storages.get(key)
            if rec is not None:
                rec[0] += 1
                return key, 0
            n = t.untyped_storage().nbytes()
            self._storages[key] = [1, n]
            self.add("gpu", n)
            return key, n

    def remove_storage(self, key: int) -> None:
        with self.lock:
            rec = self._storages.get(key)
            if rec is None:
                return
            rec[0] -= 1
            if rec[0] == 0:
                del self._storages[key]
                self.add("gpu", -rec[1])

    def add(self, tier: str, n: int) -> None:
        with self.lock:
            self.cur[tier] += n
            if self.cur[tier] > self.peak[tier]:
                self.peak[tier] = self.cur[tier]

    def reset_peak(self) -> None:
        with self.lock:
            self.peak = dict(self.cur)

    def clear(self) -> None:
        with self.lock:
            self._storages.clear()
            self.cur = {"gpu": 0, "cpu": 0, "nvme": 0}


# ---------------------------------------------------------------------------------------------------------- spill dir
def _host_id() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _process_start_ticks(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (Linux); 0 where unknown. Tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # the command name (field 2) may contain spaces and parentheses: split after its closing parenthesis
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _process_alive(pid: int, start_ticks: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another user
    if start_ticks:
        now = _process_start_ticks(pid)
        if now and now != start_ticks:
            return False  # the pid was reused by a newer process
    return True


def remove_stale_spill_dirs(nvme_dir: str) -> list[str]:
    """Remove spill subdirectories under ``nvme_dir`` left by dead processes of this host; returns their paths.

    Note: [Spill files never outlive the process]
    Each engine spills into its own ``mkdtemp`` subdirectory (mode 0o700) named with this host, its pid and the
    process start time. Files are removed at `ActivationEngine.end_step`, on errors inside `ActivationEngine.step`, at
    `ActivationEngine.close`, when the engine is garbage-collected and at interpreter exit (a `weakref.finalize`,
    which runs through `atexit`, so SIGINT / KeyboardInterrupt and `sys.exit` clean up). A process killed with
    SIGKILL (or SIGTERM, which skips `atexit`) cannot clean up: the next engine constructed on the same directory
    removes the subdirectories whose owner no longer exists.
    """
    removed = []
    host = _host_id()
    try:
        names = os.listdir(nvme_dir)
    except OSError:
        return removed
    for name in names:
        m = _SPILL_RE.match(name)
        if m is None or m.group("host") != host:
            continue
        if _process_alive(int(m.group("pid")), int(m.group("start"))):
            continue
        path = os.path.join(nvme_dir, name)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = _pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n


def _pread_all(fd: int, out: memoryview, offset: int) -> None:
    done = 0
    while done < len(out):
        n = _preadv(fd, [out[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"spill file ended after {offset + done} bytes")
        done += n


def _bytes_of(t: torch.Tensor) -> memoryview:
    """Writable memoryview of a contiguous CPU uint8 tensor."""
    return memoryview(t.numpy()).cast("B")


class _SpillFile:
    __slots__ = ("path", "fd", "size", "live", "sealed")

    def __init__(self, path: str, fd: int) -> None:
        self.path, self.fd = path, fd
        self.size = 0  # next free offset
        self.live = 0  # entries still stored in it
        self.sealed = False  # the layer's forward is over: no more appends


class _SpillDir:
    """The private spill directory of one engine: files, background I/O pools, cleanup.

    Holds no reference to the engine, so a `weakref.finalize` on the engine can call `cleanup`.
    """

    def __init__(self, root: str, io_threads: int) -> None:
        self.root = root
        self.io_threads = io_threads
        self.path: str | None = None
        self.files: dict[tuple[int, int], _SpillFile] = {}
        self.lock = threading.Lock()
        self.writer: ThreadPoolExecutor | None = None
        self.reader: ThreadPoolExecutor | None = None

    def ensure(self) -> str:
        with self.lock:
            if self.path is None:
                prefix = f"{_SPILL_PREFIX}{_host_id()}_{os.getpid()}_{_process_start_ticks(os.getpid())}_"
                self.path = tempfile.mkdtemp(prefix=prefix, dir=self.root)  # mode 0o700
                self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-spill-w")
                self.reader = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="lazytrain-spill-r")
            return self.path

    def file(self, step: int, layer: int) -> _SpillFile:
        path = self.ensure()
        with self.lock:
            f = self.files.get((step, layer))
            if f is None:
                p = os.path.join(path, f"step{step}_layer{layer:04d}.act")
                f = _SpillFile(p, os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
                self.files[(step, layer)] = f
            return f

    def reserve(self, f: _SpillFile, nbytes: int) -> int:
        with self.lock:
            off = f.size
            f.size += nbytes
            f.live += 1
            return off

    def drop(self, f: _SpillFile) -> None:
        """One entry of ``f`` released; the file goes once it is sealed and empty."""
        with self.lock:
            f.live -= 1
            if f.live <= 0 and f.sealed:
                self._remove(f)

    def seal(self, step: int, layer: int) -> None:
        with self.lock:
            f = self.files.get((step, layer))
            if f is not None:
                f.sealed = True
                if f.live <= 0:
                    self._remove(f)

    def _remove(self, f: _SpillFile) -> None:
        for key, g in list(self.files.items()):
            if g is f:
                del self.files[key]
        if f.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(f.fd)
            f.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f.path)

    def remove_all_files(self) -> None:
        with self.lock:
            for f in list(self.files.values()):
                self._remove(f)
            if self.path is not None and os.path.isdir(self.path):
                # files of a failed write may not be registered yet: the directory must end up empty
                for name in os.listdir(self.path):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.path, name))

    def file_names(self) -> list[str]:
        if self.path is None or not os.path.isdir(self.path):
            return []
        return sorted(os.listdir(self.path))

    def cleanup(self) -> None:
        """Remove every file and the directory; stop the I/O threads. Idempotent; runs at exit (finalize)."""
        for pool in (self.writer, self.reader):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self.writer = self.reader = None
        self.remove_all_files()
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


# ---------------------------------------------------------------------------------------------------------- entries
class _Entry:
    """One stored saved tensor (or recompute input) of a layer, on the tier its layer plan names."""

    __slots__ = (
        "layer",
        "tier",
        "layout",
        "holders",
        "released",
        "tensor",
        "acct_key",
        "host",
        "copy_event",
        "file",
        "offset",
        "write_future",
        "reloaded",
        "reload_key",
        "reload_event",
        "reload_future",
        "reload_stream",
        "__weakref__",
    )

    def __init__(self, layer: int, tier: str, layout: _Layout | None) -> None:
        self.layer, self.tier, self.layout = layer, tier, layout
        self.holders = 0
        self.released = False
        self.tensor: torch.Tensor | None = None  # gpu tier: the tensor itself
        self.acct_key: int | None = None
        self.host: torch.Tensor | None = None  # cpu tier: the pool buffer
        self.copy_event: Any = None  # CUDA: the D2H copy into `host` / the staging buffer
        self.file: _SpillFile | None = None  # nvme tier
        self.offset = 0
        self.write_future: Future | None = None
        self.reloaded: torch.Tensor | None = None  # the device tensor handed to autograd
        self.reload_key: int | None = None
        self.reload_event: Any = None
        self.reload_future: Future | None = None
        self.reload_stream: Any = None


class _Saved:
    """What autograd holds for a kept or offloaded tensor. Its death releases the entry's last reference.

    ``view``: ``(size, stride, storage_offset)`` of a tensor restored as a view of the entry's reloaded storage
    (See Note: [Offloaded storages are copied once]); None for the entry's own tensor.
    """

    __slots__ = ("entry", "engine", "view", "__weakref__")

    def __init__(
        self, entry: _Entry, engine: weakref.ReferenceType, view: tuple[tuple, tuple, int] | None = None
    ) -> None:
        self.entry, self.engine, self.view = entry, engine, view
        entry.holders += 1

    def __del__(self) -> None:
        engine = self.engine()
        if engine is not None:
            with contextlib.suppress(Exception):
                engine._drop_holder(self.entry)


class _ParamRef:
    """A weight packed by the executor's `ParamPacker`: only the reference is stored."""

    __slots__ = ("ref",)

    def __init__(self, ref: object) -> None:
        self.ref = ref


class _RecomputeFrame:
    """Everything needed to re-run one layer's forward in backward (one per layer call)."""

    def __init__(self, layer: int, module: nn.Module) -> None:
        self.layer = layer
        self.module = module
        self.meta: list[tuple[torch.Size, torch.dtype]] = []  # per saved tensor of the original forward
        self.input: _Entry | None = None
        self.input_requires_grad = False
        self.input_pos: int | None = None  # index in args, or None for kwargs["hidden_states"]
        self.args: tuple = ()
        self.kwargs: dict[str, Any] = {}
        self.shared: set[int] = set()
        self.cpu_rng: torch.Tensor | None = None
        self.dev_rng: torch.Tensor | None = None
        self.autocast: list[tuple[str, dict[str, Any]]] = []
        # gid -> idx -> (tensor or weight reference, acct key)
        self.recomputed: dict[int, dict[int, tuple[torch.Tensor | _ParamRef, int | None]]] = {}
        self.done_gids: set[int] = set()
        self.holders = 0
        self.released = False
        self.lock = threading.RLock()
        self.block: _BlockFrame | None = None  # block checkpointing: the block this layer call belongs to


class _BlockFrame:
    """One checkpointed block: consecutive layer calls recomputed together from the first one's saved input.

    Holds the input entry until every frame of the block is released; the frames share its lock, so a block is
    recomputed once per backward however its tensors are unpacked.
    """

    def __init__(self, start: int) -> None:
        self.start = start
        self.frames: list[_RecomputeFrame] = []
        self.input: _Entry | None = None
        self.last_out: tuple | None = None  # fingerprint of the last layer's output (forward), see _fingerprint
        self.live = 0  # frames not released yet
        self.done_gids: set[int] = set()
        self.released = False
        self.lock = threading.RLock()

    @property
    def layers(self) -> list[int]:
        return [f.layer for f in self.frames]


class _Slot:
    """What autograd holds for a tensor of a recomputed layer: an index into the recomputation."""

    __slots__ = ("frame", "idx", "engine", "__weakref__")

    def __init__(self, frame: _RecomputeFrame, idx: int, engine: weakref.ReferenceType) -> None:
        self.frame, self.idx, self.engine = frame, idx, engine
        frame.holders += 1

    def __del__(self) -> None:
        engine = self.engine()
        if engine is not None:
            with contextlib.suppress(Exception):
                engine._drop_slot(self.frame)


class _LayerCtx:
    """State of one layer call between `begin_layer` and `end_layer`."""

    __slots__ = ("layer", "tier", "hooks", "params", "shared", "frame", "dedup", "active")

    def __init__(self, layer: int, tier: str, active: bool) -> None:
        self.layer, self.tier, self.active = layer, tier, active
        self.hooks: Any = None
        self.params: set[int] = set()
        self.shared: set[int] = set()
        self.frame: _RecomputeFrame | None = None
        # storage ptr -> [(weak storage ref, version, entry, storage offset of the copied region)]
        self.dedup: dict[int, list[tuple[StorageWeakRef, int, _Entry, int]]] = {}


# ---------------------------------------------------------------------------------------------------------- engine
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
            pin_memory = device.type == "cuda"
        if pin_memory and not torch.cuda.is_available():
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
        nvme_layers = [lp.index for lp in plan.layers if lp.tier == "nvme"]
        if nvme_dir is None and nvme_layers:
            raise ValueError(
                f"the plan puts layers {nvme_layers} on the nvme tier but activation_nvme_dir=None; pass a directory "
                "on a fast local disk (e.g. activation_nvme_dir='/scratch') or plan without offload_nvme."
            )
        if nvme_dir is not None:
            nvme_dir = os.fspath(nvme_dir)
            self._check_dir(nvme_dir)
            remove_stale_spill_dirs(nvme_dir)

        self.plan = plan
        self.device = device
        self.nvme_dir = nvme_dir
        self.param_packer = param_packer
        self.pin_memory = bool(pin_memory)
        self.nvme_max_inflight_bytes = int(nvme_max_inflight_bytes)
        # None: synchronous CPU copies; else CUDA streams or the simulated asynchronous lanes (lazytrain_hf.streams)
        self._lanes = streams.lanes_for(device, ("d2h", "h2d"), "activations")
        self._async = self._lanes is not None
        self._io_delay = streams.SimDelay("nvme") if self._async and device.type == "cpu" else None
        self.pool = HostBufferPool(pin_memory=self.pin_memory, poison=self._async and device.type == "cpu")
        self._acct = _Accountant()
        self._self_ref = weakref.ref(self)
        self._stack: list[_LayerCtx] = []
        self._entries: dict[int, list[_Entry]] = {}  # layer -> entries of the current step
        self._frames: dict[int, list[weakref.ReferenceType]] = {}  # layer -> recompute frames of the current step
        # block checkpointing: the block the forward is building, and each layer's block of the latest forward
        self._open_block: _BlockFrame | None = None
        self._block_of: dict[int, weakref.ReferenceType] = {}
        self._weights = param_packer if isinstance(param_packer, RecomputeWeights) else None
        self._layer_bytes: dict[int, dict[str, int]] = {}
        self._inflight: deque[tuple[Any, torch.Tensor, int | None]] = deque()  # CUDA: (event, source, acct key)
        self._writes: deque[tuple[Future, int]] = deque()  # NVMe writes in flight: (future, staging bytes)
        self._reads: deque[Future] = deque()  # NVMe reads issued
        self._write_failure: tuple[OSError, int, int] | None = None  # (error, bytes attempted, layer)
        self._step = 0
        self._closed = False
        self._spill = _SpillDir(nvme_dir, io_threads) if nvme_dir is not None else None
        # See Note: [Spill files never outlive the process]
        self._finalizer = weakref.finalize(self, _SpillDir.cleanup, self._spill) if self._spill else None
        self._d2h = self._lanes["d2h"] if self._async else None
        self._h2d = self._lanes["h2d"] if self._async else None

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_dir(path: str) -> None:
        if not os.path.isdir(path):
            raise ValueError(
                f"activation_nvme_dir={path!r} does not exist or is not a directory; create it (mkdir -p) or pass "
                "an existing directory on a fast local disk."
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(
                f"activation_nvme_dir={path!r} is not writable by this process; pass a directory you can write to."
            )

    def check_nvme_capacity(self, bytes_needed: int) -> None:
        """Raise ValueError unless the spill directory exists, is writable and has ``bytes_needed`` bytes free."""
        if self.nvme_dir is None:
            raise ValueError(
                f"the NVMe tier needs {bytes_needed} bytes ({format_bytes(bytes_needed)}) but activation_nvme_dir=None; "
                "pass a directory on a fast local disk."
            )
        if isinstance(bytes_needed, bool) or not isinstance(bytes_needed, int) or bytes_needed < 0:
            raise ValueError(f"bytes_needed={bytes_needed!r} must be a non-negative int number of bytes.")
        self._check_dir(self.nvme_dir)
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
        return self._spill.path if self._spill is not None else None

    def spill_files(self) -> list[str]:
        """Names of the spill files that exist now (empty between steps)."""
        return self._spill.file_names() if self._spill is not None else []

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
        ctx = _LayerCtx(layer, lp.tier, active)
        if active:
            ctx.params = {_storage_key(p) for p in module.parameters()} | {_storage_key(b) for b in module.buffers()}
            shared = _tensors_in(args[1:], []) + _tensors_in(
                {k: v for k, v in kwargs.items() if k != "hidden_states"}, []
            )
            ctx.shared = {_storage_key(t) for t in shared if _plain_strided(t)}
            if self.plan.checkpoint_every > 1:  # validate(): every layer is "recompute" on the gpu tier
                ctx.frame = self._block_frame(layer, module, args, kwargs, ctx.shared)
            elif lp.policy == "recompute":
                ctx.frame = self._new_frame(layer, module, args, kwargs, lp.tier, ctx.shared)
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
            ctx.frame.block.last_out = _fingerprint(out) if isinstance(out, torch.Tensor) else None
        ctx.dedup.clear()
        if self._spill is not None:
            self._spill.seal(self._step, layer)
        self._poll_inflight()
        self._raise_write_failure()

    # ------------------------------------------------------------------ pack
    def _pack(self, ctx: _LayerCtx, t: torch.Tensor) -> Any:
        # A recomputed layer stores nothing but the index of each saved tensor, weights included, so the
        # recomputation (which records every saved tensor) serves the same sequence.
        if ctx.frame is not None:
            frame = ctx.frame
            frame.meta.append((t.shape, t.dtype))
            return _Slot(frame, len(frame.meta) - 1, self._self_ref)
        # Note: [Weights are never offloaded]
        # Weights come back from the executor's slot (packer) or are kept by reference; they are neither copied nor
        # counted as activations. Shared inputs (rotary cos/sin, masks) are alive anyway: also by reference.
        if self.param_packer is not None:
            ref = self.param_packer.pack(t)
            if ref is not None:
                return _ParamRef(ref)
        if not _plain_strided(t) or t.device != self.device or t.numel() == 0:
            return t
        key = _storage_key(t)
        if key in ctx.params or key in ctx.shared:
            return t
        if ctx.tier == "gpu":
            return _Saved(self._keep_entry(ctx.layer, t), self._self_ref)
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
                return _Saved(entry, self._self_ref, view)
            if lo == off0 and lay.size == tuple(t.shape) and lay.stride == tuple(t.stride()):
                return _Saved(entry, self._self_ref)
        t = t.detach()  # the copies below must not record autograd history
        layout = _Layout.of(t)
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
                layout = _Layout.of(t)  # of the whole-storage view now saved
        entry = self._offload_entry(ctx.layer, ctx.tier, t, layout)
        if entry.tier != "gpu":
            cands.append((StorageWeakRef(t.untyped_storage()), version, entry, lo))
        return _Saved(entry, self._self_ref, view)

    def _keep_entry(self, layer: int, t: torch.Tensor) -> _Entry:
        entry = _Entry(layer, "gpu", None)
        entry.tensor = t
        entry.acct_key, n = self._acct.add_storage(t)
        self._count_layer(layer, "gpu", n)
        self._entries.setdefault(layer, []).append(entry)
        return entry

    def _offload_entry(self, layer: int, tier: str, t: torch.Tensor, layout: _Layout | None = ...) -> _Entry:
        """Copy ``t`` to ``tier``; ``layout`` is `_Layout.of(t)` when the caller already has it."""
        if layout is ...:
            layout = _Layout.of(t)
        if layout is None:  # overlapping view: see Note: [Saved tensors are restored with their layout]
            return self._keep_entry(layer, t)
        entry = _Entry(layer, tier, layout)
        nbytes = layout.nbytes
        buf = self.pool.get(nbytes)
        host = layout.host_view(buf)
        src = layout.source(t)
        if self._async:
            # Note: [D2H waits for the producer]
            # The side stream must not read the activation before the compute stream has written it.
            ev = self._d2h.copy(host, src, after_compute=True)
            # Note: [Offload source stays alive until its copy completes]
            # Autograd drops its reference to `t` now (it holds our `_Saved`); the caching allocator could hand the
            # block to the next kernel while the D2H copy still reads it. The source is held in `_inflight` until
            # its event completes (polled at every pack / end_layer), instead of record_stream, whose deferred
            # frees fragment the allocator. It counts as device bytes until then.
            key, _ = self._acct.add_storage(t)
            self._inflight.append((ev, t, key))
            entry.copy_event = ev
        else:
            host.copy_(src)
        self._acct.add("cpu", nbytes)
        if tier == "cpu":
            entry.host = buf
        else:
            self._submit_write(entry, buf)
        self._count_layer(layer, tier, nbytes)
        self._entries.setdefault(layer, []).append(entry)
        self._poll_inflight()
        self._raise_write_failure()
        return entry

    def _count_layer(self, layer: int, tier: str, n: int) -> None:
        d = self._layer_bytes.setdefault(layer, {"gpu": 0, "cpu": 0, "nvme": 0})
        d[tier] += n

    def _poll_inflight(self) -> None:
        while self._inflight and self._inflight[0][0].query():
            _, _, key = self._inflight.popleft()
            self._acct.remove_storage(key)

    # ------------------------------------------------------------------ nvme I/O
    def _submit_write(self, entry: _Entry, staging: torch.Tensor) -> None:
        spill = self._spill
        nbytes = entry.layout.nbytes
        f = spill.file(self._step, entry.layer)
        entry.file = f
        entry.offset = spill.reserve(f, nbytes)
        self._acct.add("nvme", nbytes)
        # bound the staging memory of writes in flight: wait for the oldest ones first
        inflight = sum(n for _, n in self._writes)
        while self._writes and inflight + nbytes > self.nvme_max_inflight_bytes:
            fut, n = self._writes.popleft()
            with contextlib.suppress(Exception):
                fut.result()
            inflight -= n
        while self._writes and self._writes[0][0].done():
            self._writes.popleft()
        event = entry.copy_event
        pool, acct, layer = self.pool, self._acct, entry.layer
        failure = self._record_write_failure

        delay = self._io_delay

        def write() -> None:
            try:
                if delay is not None:
                    delay.sleep()
                if event is not None:
                    event.synchronize()  # the D2H copy into the pinned staging buffer
                _pwrite_all(f.fd, _bytes_of(staging[:nbytes]), entry.offset)
            except OSError as e:
                failure(e, nbytes, layer)
                raise
            finally:
                pool.put(staging)
                acct.add("cpu", -nbytes)

        entry.write_future = spill.writer.submit(write)
        self._writes.append((entry.write_future, nbytes))

    def _record_write_failure(self, e: OSError, nbytes: int, layer: int) -> None:
        if self._write_failure is None:
            self._write_failure = (e, nbytes, layer)

    def _raise_write_failure(self) -> None:
        failure = self._write_failure
        if failure is None:
            return
        e, nbytes, layer = failure
        self._write_failure = None
        # wait for the other writes and reads, then remove every spill file of the step before raising
        self._wait_io()
        self._spill.remove_all_files()
        free = shutil.disk_usage(self.nvme_dir).free if os.path.isdir(self.nvme_dir) else 0
        raise ActivationSpillError(
            e.errno,
            f"activation_nvme_dir={self.nvme_dir!r}: writing {nbytes} bytes ({format_bytes(nbytes)}) of layer "
            f"{layer}'s activations failed: {e.strerror or e} ({free} bytes free). The spill files were removed. Free "
            "space there, point activation_nvme_dir at a larger disk, or plan fewer layers with offload_nvme.",
        )

    def _read_nvme(self, entry: _Entry, narrow: torch.Tensor, storage: torch.Tensor, alloc_event: Any) -> Any:
        """Background reader: spill file -> device tensor. Returns the CUDA event of the H2D copy (None on CPU)."""
        layout, f = entry.layout, entry.file
        entry.write_future.result()  # reads follow the write of the same bytes
        if self._io_delay is not None:
            self._io_delay.sleep()
        if not self._async and layout.dense:
            _pread_all(f.fd, _bytes_of(layout.landing_bytes(storage)), entry.offset)  # lands in place
            return None
        staging = self.pool.get(layout.nbytes)
        _pread_all(f.fd, _bytes_of(staging[: layout.nbytes]), entry.offset)
        if not self._async:
            narrow.copy_(layout.host_view(staging))
            self.pool.put(staging)
            return None
        # See Note: [H2D waits for the block's previous users]
        ev = self._h2d.copy(narrow, layout.host_view(staging), after=(alloc_event,))
        self.pool.put(staging, ev)  # See Note: [Pool buffers carry their last copy]
        return ev

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
            self._issue_reload(e)

    def _issue_reload(self, entry: _Entry) -> None:
        with self._acct.lock:
            if entry.released or entry.reloaded is not None:
                return
            layout = entry.layout
            storage, narrow, final = layout.empty(self.device)
            entry.reloaded = final
            entry.reload_key, _ = self._acct.add_storage(final)
        if self._async:
            if self.device.type == "cuda":
                entry.reload_stream = torch.cuda.current_stream(self.device)
            if entry.tier == "cpu":
                # Note: [H2D waits for the block's previous users]
                # `storage` was allocated on the current stream, whose earlier kernels may still use the block it
                # reuses; the side stream writes only after them. Note: [Reload waits for the offload copy]: and
                # only after the D2H copy that filled the host buffer.
                entry.reload_event = self._h2d.copy(
                    narrow, layout.host_view(entry.host), after=(entry.copy_event,), after_compute=True
                )
            else:
                alloc_event = self._lanes.compute_event()
                entry.reload_future = self._spill.reader.submit(self._read_nvme, entry, narrow, storage, alloc_event)
                self._track_read(entry.reload_future)
        elif entry.tier == "cpu":
            narrow.copy_(layout.host_view(entry.host))
        else:
            entry.reload_future = self._spill.reader.submit(self._read_nvme, entry, narrow, storage, None)
            self._track_read(entry.reload_future)

    def _track_read(self, fut: Future) -> None:
        with self._acct.lock:
            while self._reads and self._reads[0].done():
                self._reads.popleft()
            self._reads.append(fut)

    def _wait_io(self) -> None:
        """Wait for every NVMe write and read in flight (before files are closed: their fds must stay valid)."""
        for fut, _ in list(self._writes):
            with contextlib.suppress(Exception):
                fut.result()
        self._writes.clear()
        with self._acct.lock:
            reads = list(self._reads)
            self._reads.clear()
        for fut in reads:
            with contextlib.suppress(Exception):
                fut.result()

    def _materialize(self, entry: _Entry) -> torch.Tensor:
        """The device tensor of an entry, reloading on demand and waiting for the reload."""
        if entry.tier == "gpu":
            if entry.tensor is None:
                raise RuntimeError(
                    f"a saved activation of layer {entry.layer} was released by end_step() before backward used it; "
                    "call end_step() only after backward."
                )
            return entry.tensor
        if entry.released:
            raise RuntimeError(
                f"a saved activation of layer {entry.layer} was released by end_step() before backward used it; "
                "call end_step() only after backward."
            )
        self._issue_reload(entry)
        fut = entry.reload_future
        if fut is not None:
            try:
                ev = fut.result()
            except OSError as e:
                self._raise_write_failure()
                raise OSError(
                    e.errno, f"reading layer {entry.layer}'s activations back from {self.spill_dir!r} failed: {e}"
                ) from e
            entry.reload_future = None
            entry.reload_event = ev
        out = entry.reloaded
        if self._async:
            self._lanes.compute_wait(entry.reload_event)
        if self.device.type == "cuda":
            cur = torch.cuda.current_stream(self.device)
            if entry.reload_stream is not None and entry.reload_stream != cur:
                out.record_stream(cur)  # allocated on another stream than the one that frees it
        return out

    # ------------------------------------------------------------------ unpack
    def _unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, _Saved):
            out = self._materialize(obj.entry)
            return out if obj.view is None else out.as_strided(*obj.view)
        if isinstance(obj, _Slot):
            return self._unpack_slot(obj)
        if isinstance(obj, _ParamRef):
            return self.param_packer.unpack(obj.ref)
        return obj

    # ------------------------------------------------------------------ recompute
    @staticmethod
    def _layer_input(layer: int, args: tuple, kwargs: dict) -> tuple[torch.Tensor, int | None]:
        """The hidden-states input of a layer call and where it is: ``(x, 0)`` for args[0], ``(x, None)`` for
        kwargs["hidden_states"]."""
        if args and isinstance(args[0], torch.Tensor):
            return args[0], 0
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return kwargs["hidden_states"], None
        raise ValueError(
            f"layer {layer} uses policy='recompute' but its input is neither args[0] nor kwargs['hidden_states'] "
            "as a tensor; plan another policy for this layer."
        )

    def _block_frame(
        self, layer: int, module: nn.Module, args: tuple, kwargs: dict, shared: set[int]
    ) -> _RecomputeFrame:
        """The frame of a layer call under block checkpointing: the first layer of a block saves its input on the
        device; a later layer of the block saves nothing and is recomputed from the previous layer's output."""
        K = self.plan.checkpoint_every
        x, _ = self._layer_input(layer, args, kwargs)
        block = self._open_block
        cont = (
            layer % K != 0
            and block is not None
            and not block.released
            and block.frames[-1].layer == layer - 1
            and block.start <= layer < block.start + K
        )
        if cont and (block.last_out is None or block.last_out != _fingerprint(x)):
            # the previous layer's output was not passed to end_layer, or this input is not that output (a
            # modified or different tensor): the recomputation could not chain, so this layer starts a block
            cont = False
            warnings.warn(
                f"block checkpointing (checkpoint_every={K}): the input of layer {layer} is not the output of layer "
                f"{layer - 1} as passed to end_layer(); layer {layer} starts a new block and saves its input.",
                stacklevel=3,
            )
        if cont:
            frame = self._new_frame(layer, module, args, kwargs, "gpu", shared, save_input=False)
        else:
            frame = self._new_frame(layer, module, args, kwargs, "gpu", shared)
            block = _BlockFrame(layer)
            block.input, frame.input = frame.input, None  # the block holds the input (its holder count moves)
            self._open_block = block
        frame.block = block
        frame.lock = block.lock
        block.frames.append(frame)
        block.live += 1
        block.last_out = None
        self._block_of[layer] = weakref.ref(block)
        return frame

    def _new_frame(
        self,
        layer: int,
        module: nn.Module,
        args: tuple,
        kwargs: dict,
        tier: str,
        shared: set[int],
        save_input: bool = True,
    ) -> _RecomputeFrame:
        frame = _RecomputeFrame(layer, module)
        x, frame.input_pos = self._layer_input(layer, args, kwargs)
        frame.args = tuple(args)
        frame.kwargs = {k: (_NO_REPLAY_KWARGS[k] if k in _NO_REPLAY_KWARGS else v) for k, v in kwargs.items()}
        if frame.input_pos is None:
            frame.kwargs["hidden_states"] = None
        else:
            frame.args = (None,) + frame.args[1:]
        frame.shared = shared
        frame.input_requires_grad = x.requires_grad
        # the input goes to the layer's input tier, like any saved tensor of that tier
        if save_input:
            if tier == "gpu" or not _plain_strided(x) or x.device != self.device:
                frame.input = self._keep_entry(layer, x.detach())
            else:
                frame.input = self._offload_entry(layer, tier, x.detach())
            frame.input.holders += 1  # held by the frame (or its block) until it is released
        # Note: [Recompute replays RNG and autocast state]
        # Captured before the layer's forward draws any random number, restored (inside fork_rng, so the training
        # RNG stream is untouched) before the recomputation: dropout masks come out identical.
        frame.cpu_rng = torch.get_rng_state()
        if self.device.type == "cuda":
            frame.dev_rng = torch.cuda.get_rng_state(self.device)
            frame.autocast.append(
                (
                    "cuda",
                    {
                        "enabled": torch.is_autocast_enabled("cuda"),
                        "dtype": torch.get_autocast_dtype("cuda"),
                        "cache_enabled": torch.is_autocast_cache_enabled(),
                    },
                )
            )
        frame.autocast.append(
            (
                "cpu",
                {
                    "enabled": torch.is_autocast_enabled("cpu"),
                    "dtype": torch.get_autocast_dtype("cpu"),
                    "cache_enabled": torch.is_autocast_cache_enabled(),
                },
            )
        )
        self._frames.setdefault(layer, []).append(weakref.ref(frame))
        return frame

    def _unpack_slot(self, slot: _Slot) -> torch.Tensor:
        frame = slot.frame
        gid = torch._C._current_graph_task_id()
        with frame.lock:
            if frame.released:
                raise RuntimeError(
                    f"the recomputation state of layer {frame.layer} was released by end_step() before backward "
                    "used it; call end_step() only after backward."
                )
            if gid == -1:
                # unpacked outside backward (e.g. reading grad_fn._saved_*): recompute and keep nothing
                if frame.block is not None:
                    tensors = self._recompute_block(frame.block, count=False, upto=frame)[frame]
                else:
                    tensors = self._recompute(frame, count=False)
                return self._resolve(tensors[slot.idx][0])
            # Note: [Recompute serves tensors by index, per backward]
            # One recomputation per backward (graph task) serves every saved tensor of the layer once, like
            # torch.utils.checkpoint(use_reentrant=False); a second backward over a retained graph recomputes again.
            if gid not in frame.recomputed:
                if gid in frame.done_gids:
                    raise RuntimeError(f"a saved tensor of recomputed layer {frame.layer} was unpacked twice.")
                if frame.block is not None:
                    self._recompute_block_for(frame.block, gid)
                else:
                    frame.recomputed[gid] = self._recompute(frame, count=True)
                    frame.done_gids.add(gid)
            served = frame.recomputed[gid]
            if slot.idx not in served:
                raise RuntimeError(f"a saved tensor of recomputed layer {frame.layer} was unpacked twice.")
            t, key = served.pop(slot.idx)
            if not served:
                del frame.recomputed[gid]
        if key is not None:
            self._acct.remove_storage(key)
        return self._resolve(t)

    def _resolve(self, t: torch.Tensor | _ParamRef) -> torch.Tensor:
        """A recorded tensor, or the weight view a recorded reference names (rebuilt on the layer's current slot)."""
        return self.param_packer.unpack(t.ref) if isinstance(t, _ParamRef) else t

    def begin_backward(self, layer: int) -> None:
        """Stage ``B layer`` starts (the executor's backward pre-hook, inside backward).

        Under block checkpointing the first backward stage of a block (its top layer) recomputes the whole block
        now, before any of its tensors is unpacked (See Note: [Block recomputation]). A no-op for per-layer
        policies, outside a backward, and for a block already recomputed in this backward.
        """
        if self.plan.checkpoint_every == 1:
            return
        ref = self._block_of.get(layer)
        block = ref() if ref is not None else None
        gid = torch._C._current_graph_task_id()
        if block is None or gid == -1:
            return
        with block.lock:
            if not block.released and gid not in block.done_gids:
                self._recompute_block_for(block, gid)

    def _recompute_block_for(self, block: _BlockFrame, gid: int) -> None:
        """Recompute ``block`` for backward ``gid`` and hand every live frame its tensors (under ``block.lock``)."""
        outs = self._recompute_block(block, count=True)
        block.done_gids.add(gid)
        for frame, out in outs.items():
            frame.recomputed[gid] = out
            frame.done_gids.add(gid)

    def _recompute_block(
        self, block: _BlockFrame, count: bool, upto: _RecomputeFrame | None = None
    ) -> dict[_RecomputeFrame, dict[int, tuple[torch.Tensor | _ParamRef, int | None]]]:
        """Re-run the block's layers in order from its saved input; saved tensors per frame (frames released
        already run, to feed the next layer, but record nothing). ``upto``: stop after that frame.

        Note: [Block recomputation]
        Layer ``k`` of the block runs on the output of layer ``k - 1``'s recomputation (the forward checked that
        its input was that output, `_block_frame`), with its own captured RNG / autocast state and keyword
        arguments, so it saves bit-identical tensors. Its weights are bound by the executor for the duration
        (`RecomputeWeights.recompute_weights`) and may be released right after: saved weights are recorded as the
        executor's references (`ParamPacker.pack`) and rebuilt on the layer's slot of the backward when unpacked,
        never as views of the slot used for the recomputation. Recorded activations count as device bytes until
        autograd unpacks them.
        """
        frames = block.frames
        if upto is not None:
            frames = frames[: frames.index(upto) + 1]
        outs: dict[_RecomputeFrame, dict[int, tuple[torch.Tensor | _ParamRef, int | None]]] = {}
        x = self._materialize(block.input)
        try:
            for n, frame in enumerate(frames):
                nxt = frames[n + 1].layer if n + 1 < len(frames) else None
                bind = self._weights.recompute_weights(frame.layer, nxt) if self._weights else contextlib.nullcontext()
                with bind:
                    out, y = self._run_forward(frame, x, count and not frame.released, weight_refs=True)
                if not frame.released:
                    outs[frame] = out
                if not isinstance(y, torch.Tensor):
                    raise RuntimeError(
                        f"recomputing block {block.layers}: layer {frame.layer} returned {type(y).__name__}, not the "
                        "hidden states; use checkpoint_every=1 for this model."
                    )
                x = y.detach()
        except BaseException:
            for out in outs.values():
                for _, key in out.values():
                    if key is not None:
                        self._acct.remove_storage(key)
            raise
        return outs

    def _recompute(self, frame: _RecomputeFrame, count: bool) -> dict[int, tuple[torch.Tensor, int | None]]:
        """Re-run the layer's forward under recording hooks; saved tensors by index (with accounting keys)."""
        return self._run_forward(frame, self._materialize(frame.input), count)[0]

    def _run_forward(
        self, frame: _RecomputeFrame, x: torch.Tensor, count: bool, weight_refs: bool = False
    ) -> tuple[dict[int, tuple[torch.Tensor | _ParamRef, int | None]], Any]:
        """Run ``frame``'s layer forward on input ``x`` with its RNG / autocast state under recording hooks.

        Returns the saved tensors by index (with accounting keys when ``count``) and the hidden states it returned.
        ``weight_refs``: weights the executor's packer recognises are recorded as its references.
        """
        x = x.detach().requires_grad_(frame.input_requires_grad)
        args, kwargs = frame.args, dict(frame.kwargs)
        if frame.input_pos is None:
            kwargs["hidden_states"] = x
        else:
            args = (x,) + args[1:]
        module = frame.module
        # weights are bound again (the executor's backward pre-hook): never count them as activations
        skip = {_storage_key(p) for p in module.parameters()} | {_storage_key(b) for b in module.buffers()}
        skip |= frame.shared
        expected = frame.meta
        out: dict[int, tuple[torch.Tensor | _ParamRef, int | None]] = {}
        acct = self._acct
        packer = self.param_packer if weight_refs else None

        def pack(t: torch.Tensor) -> None:
            i = len(out)
            if i >= len(expected) or expected[i] != (t.shape, t.dtype):
                want = expected[i] if i < len(expected) else "nothing"
                raise RuntimeError(
                    f"recomputing layer {frame.layer}: saved tensor {i} is {tuple(t.shape)} {t.dtype}, the original "
                    f"forward saved {want}. The layer's forward is not deterministic in what it saves; plan another "
                    "policy than recompute for it."
                )
            ref = packer.pack(t) if packer is not None else None
            if ref is not None:
                out[i] = (_ParamRef(ref), None)
                return None
            t = t.detach() if t.requires_grad else t
            key = None
            if count and _plain_strided(t) and t.device == self.device and _storage_key(t) not in skip:
                key, _ = acct.add_storage(t)
            out[i] = (t, key)
            return None

        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices, enabled=True, device_type=self.device.type):
                torch.set_rng_state(frame.cpu_rng)
                if frame.dev_rng is not None:
                    torch.cuda.set_rng_state(frame.dev_rng, self.device)
                with contextlib.ExitStack() as stack:
                    for device_type, kw in frame.autocast:
                        stack.enter_context(torch.amp.autocast(device_type, **kw))
                    stack.enter_context(torch.enable_grad())
                    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None))
                    # `module.forward`, not `module(...)`: the executor's hooks on this layer must not fire again
                    result = module.forward(*args, **kwargs)
            if len(out) != len(expected):
                raise RuntimeError(
                    f"recomputing layer {frame.layer} saved {len(out)} tensors, the original forward saved "
                    f"{len(expected)}; plan another policy than recompute for it."
                )
        except BaseException:
            for _, key in out.values():
                if key is not None:
                    acct.remove_storage(key)
            raise
        hidden = result[0] if isinstance(result, tuple | list) and result else result
        return out, hidden

    # ------------------------------------------------------------------ release
    def _drop_holder(self, entry: _Entry) -> None:
        with self._acct.lock:
            entry.holders -= 1
            last = entry.holders <= 0
        if last:
            # outside the lock: releasing waits for I/O threads, which take the lock to account bytes
            self._release(entry)

    def _drop_slot(self, frame: _RecomputeFrame) -> None:
        with frame.lock:
            frame.holders -= 1
            if frame.holders <= 0:
                self._release_frame(frame)

    def _release_frame(self, frame: _RecomputeFrame) -> None:
        with frame.lock:
            if frame.released:
                return
            frame.released = True
            for served in frame.recomputed.values():
                for _, key in served.values():
                    if key is not None:
                        self._acct.remove_storage(key)
            frame.recomputed.clear()
            if frame.input is not None:
                self._drop_holder(frame.input)
            block = frame.block
            if block is None:
                frame.args, frame.kwargs = (), {}
                return
            # a block keeps its frames' call arguments (the recomputation replays every layer) and its input until
            # the last of its frames is released
            block.live -= 1
            if block.live <= 0:
                self._release_block(block)

    def _release_block(self, block: _BlockFrame) -> None:
        with block.lock:
            if block.released:
                return
            block.released = True
            for frame in block.frames:
                frame.args, frame.kwargs = (), {}
            if block.input is not None:
                entry, block.input = block.input, None
                self._drop_holder(entry)

    def _release(self, entry: _Entry) -> None:
        """Give back everything an entry holds (device tensors, host buffer, file bytes). Idempotent."""
        with self._acct.lock:
            if entry.released:
                return
            entry.released = True
            entry.tensor = None
            if entry.acct_key is not None:
                self._acct.remove_storage(entry.acct_key)
                entry.acct_key = None
            fut = entry.reload_future
        if fut is not None:
            with contextlib.suppress(Exception):
                fut.result()  # the reader writes into `reloaded`: let it finish before dropping it
        if entry.reload_event is not None:
            entry.reload_event.synchronize()
        with self._acct.lock:
            entry.reloaded = None
            entry.reload_future = None
            if entry.reload_key is not None:
                self._acct.remove_storage(entry.reload_key)
                entry.reload_key = None
            if entry.host is not None:
                # the H2D copy of a reload may still read it; See Note: [Pool buffers carry their last copy]
                self.pool.put(entry.host, entry.reload_event or entry.copy_event)
                entry.host = None
                self._acct.add("cpu", -entry.layout.nbytes)
            if entry.file is not None:
                self._acct.add("nvme", -entry.layout.nbytes)
                f, entry.file = entry.file, None
                self._spill.drop(f)

    # ------------------------------------------------------------------ step
    def synchronize(self) -> None:
        """Wait for every copy and write in flight (benchmarks, memory snapshots)."""
        if self._lanes is not None:
            self._lanes.synchronize()
        self._poll_inflight()
        for fut, _ in list(self._writes):
            with contextlib.suppress(Exception):
                fut.result()
        self._writes.clear()
        self._raise_write_failure()

    def end_step(self) -> None:
        """After backward: drop everything this step stored, delete its spill files; raise a pending write error."""
        self._end_step(raise_errors=True)

    def _end_step(self, raise_errors: bool) -> None:
        while self._stack:  # a forward that raised between begin_layer and end_layer
            ctx = self._stack.pop()
            if ctx.hooks is not None:
                ctx.hooks.__exit__(None, None, None)
        if self._lanes is not None:
            self._lanes.synchronize()
        self._wait_io()
        for refs in self._frames.values():
            for ref in refs:
                frame = ref()
                if frame is not None:
                    self._release_frame(frame)
        for ref in self._block_of.values():
            block = ref()
            if block is not None:
                self._release_block(block)
        self._block_of.clear()
        self._open_block = None
        for entries in self._entries.values():
            for e in entries:
                self._release(e)
        self._entries.clear()
        self._frames.clear()
        while self._inflight:
            ev, _, key = self._inflight.popleft()
            ev.synchronize()
            self._acct.remove_storage(key)
        if self._spill is not None:
            self._spill.remove_all_files()
        self._acct.clear()
        self._step += 1
        failure, self._write_failure = self._write_failure, None
        if failure is not None and raise_errors:
            self._write_failure = failure
            self._raise_write_failure()

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
        if self._lanes is not None:
            self._lanes.close()
        self.pool.clear()
        if self._finalizer is not None:
            self._finalizer()  # runs _SpillDir.cleanup once and detaches it from exit handling

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
        self._poll_inflight()  # offload sources whose copy has landed are no longer device bytes
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
        return {k: dict(v) for k, v in sorted(self._layer_bytes.items())}

    def reset_layer_bytes(self) -> None:
        self._layer_bytes.clear()

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


# ---------------------------------------------------------------------------------------------------------- standalone
class StandaloneHandle:
    """Hooks installed by `attach_standalone`; `remove` takes them all off."""

    def __init__(self, model: nn.Module, engine: ActivationEngine, prefetch: bool) -> None:
        self.model, self.engine, self.prefetch = model, engine, prefetch
        self.handles: list[Any] = []
        self.reload_stages: dict[int, list[int]] = {}
        for stage, items in engine.plan.issue_schedule().items():
            layers = [i for what, i in items if what == "reload"]
            if layers:
                self.reload_stages[stage] = layers
        self.issued: list[tuple[int, int]] = []  # (stage, layer) in issue order, for tests

    def issue(self, stage: int) -> None:
        if not self.prefetch:
            return
        for layer in self.reload_stages.get(stage, ()):
            self.issued.append((stage, layer))
            self.engine.prefetch(layer)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def __repr__(self) -> str:
        return (
            f"StandaloneHandle(layers={self.engine.plan.num_layers}, prefetch={self.prefetch}, engine={self.engine})"
        )


def attach_standalone(model: nn.Module, engine: ActivationEngine, prefetch: bool = True) -> StandaloneHandle:
    """Drive ``engine`` from hooks on an ordinary (un-streamed) HF model, as the streaming executor would.

    Forward pre/post hooks on each decoder layer call `ActivationEngine.begin_layer` / `end_layer`; reloads are
    issued at the stages ``engine.plan.issue_schedule()`` names: forward stages in the layer pre-hooks, the head
    stage when the last layer's forward ends, the backward stage of layer ``i`` when the gradient of its output
    arrives (where `ActivationEngine.begin_backward` also runs). Call ``engine.end_step()`` (or use
    ``with engine.step():``) after backward.

    Args:
        model: a `*ForCausalLM` of a type in `lazytrain_hf.models.MODEL_TABLE`.
        engine: the engine; its plan must have one layer per decoder layer.
        prefetch: issue reloads per the plan (False: every reload happens on demand at unpack).

    Returns:
        `StandaloneHandle`; ``handle.remove()`` takes every hook off again.
    """
    from .models import decoder_layers

    layers = decoder_layers(model)
    L = engine.plan.num_layers
    if len(layers) != L:
        raise ValueError(
            f"the plan has {L} layers but the model has {len(layers)} decoder layers; plan for this model."
        )
    handle = StandaloneHandle(model, engine, prefetch)

    for i, layer in enumerate(layers):

        def pre(module: nn.Module, args: tuple, kwargs: dict, i: int = i) -> None:
            handle.issue(i)  # stage F i
            engine.begin_layer(i, module, args, kwargs)

        def post(module: nn.Module, args: tuple, kwargs: dict, output: Any, i: int = i) -> None:
            engine.end_layer(i, output)
            if i == L - 1:
                handle.issue(L)  # stage H starts when the last layer's forward ends
            out = output[0] if isinstance(output, tuple | list) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:

                def on_grad(grad: torch.Tensor, i: int = i) -> None:
                    handle.issue(2 * L - i)  # stage B i starts when the gradient of its output arrives
                    engine.begin_backward(i)

                out.register_hook(on_grad)

        handle.handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handle.handles.append(layer.register_forward_hook(post, with_kwargs=True, always_call=True))
    return handle
