"""The NVMe tier: spill files in a private directory, background writes and reads, and their failures.

Owns the spill directory of one engine (`SpillDir`: files, the writer and reader thread pools, cleanup, stale
directories of dead processes) and `NvmeTier`, the tier backend (`tiers.py` interface) that stages a saved tensor
through a pooled host buffer, writes it to its layer's spill file and reads it back when its reload is issued. A
failed write (ENOSPC, EIO) removes every spill file of the step and is raised on the training thread as
`ActivationSpillError`, naming the directory, the bytes and the fix.

Note: [Spilled bytes leave RAM]
    A spill exists to free host memory, so its bytes must not stay in the page cache (buffered writes would keep
    every spilled activation resident until the kernel decides to evict it, and a reload would read RAM, not the
    disk: not what `planner.hardware.measure`'s NVMe probe, which fsyncs and drops the cache, measured). The spill
    I/O mode is chosen once per spill directory (`SpillDir.io_mode`, with the reason in `SpillDir.io_reason`):

    - ``direct`` (preferred): files opened with ``O_DIRECT``; every write and read moves whole `IO_ALIGN`-byte
      blocks between a host buffer aligned to `IO_ALIGN` and a file offset aligned to `IO_ALIGN` (entries are
      reserved at aligned offsets, sizes rounded up; staging buffers are aligned views into pool buffers,
      `tiers.aligned`). The page cache is never used.
    - ``fadvise``: where the filesystem refuses ``O_DIRECT`` (tmpfs, some FUSE and network filesystems; probed with
      one aligned block when the directory is made) or the platform lacks it: ``pwrite`` + ``fdatasync`` +
      ``posix_fadvise(DONTNEED)`` over the entry's pages after each write, ``pread`` + ``DONTNEED`` after each
      read, so the pages are dropped once clean. (On tmpfs the file *is* RAM: no mode can move it elsewhere.)
    - ``buffered``: plain page-cache I/O; only when asked for (``nvme_io="buffered"``, for comparisons) or where
      neither mechanism exists.

    Bytes round-trip bit-exactly in every mode (``tests/test_nvme_io.py``, which also measures page-cache
    residency of the spill files with ``mincore``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import queue
import re
import shutil
import socket
import tempfile
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch

from .. import streams
from ..units import format_bytes
from .layout import Layout
from .tiers import Entry, Tier, TierContext, aligned, round_up

_SPILL_PREFIX = "lazytrain-act_"
_SPILL_RE = re.compile(r"^lazytrain-act_(?P<host>[0-9a-f]{8})_(?P<pid>\d+)_(?P<start>\d+)_")

# Indirection so tests can inject I/O failures (ENOSPC) without touching the `os` module other code uses.
_pwrite = os.pwrite
_preadv = os.preadv

# Block size of O_DIRECT transfers: buffer addresses, file offsets and lengths are multiples of it. 4096 covers
# drives with 512-byte and 4 KiB logical blocks (Linux requires the logical block size; 4096 is a multiple of both).
IO_ALIGN = 4096
IO_MODES = ("auto", "direct", "fadvise", "buffered")


def probe_direct_io(directory: str) -> str | None:
    """None when ``O_DIRECT`` reads and writes of one aligned block work in ``directory``, else the reason."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    path = os.path.join(directory, f".direct-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as e:
        return f"the filesystem of {directory!r} refuses O_DIRECT ({e.strerror or e}; e.g. tmpfs)"
    try:
        out, back = mmap.mmap(-1, IO_ALIGN), mmap.mmap(-1, IO_ALIGN)  # anonymous maps are page-aligned
        out.write(bytes(range(256)) * (IO_ALIGN // 256))
        if os.pwrite(fd, out, 0) != IO_ALIGN or os.preadv(fd, [back], 0) != IO_ALIGN or back[:] != out[:]:
            return f"O_DIRECT I/O in {directory!r} moved fewer or other bytes than asked"
    except OSError as e:
        return f"O_DIRECT I/O in {directory!r} failed ({e.strerror or e})"
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
    return None


def page_cache_bytes(path: str) -> int | None:
    """Bytes of the file at ``path`` resident in the page cache now (``mmap`` + ``mincore``, as ``fincore`` does);
    None where the platform has no ``mincore``. Maps the file without touching its pages."""
    import ctypes
    import ctypes.util

    size = os.path.getsize(path)
    if size == 0:
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    pages = -(-size // page)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path!r} failed")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path!r} failed")
            resident = sum(v & 1 for v in vec)
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return min(size, resident * page)


def no_readahead(fd: int) -> None:
    """Tell the kernel not to read ahead of the reads on ``fd`` (``POSIX_FADV_RANDOM``): in ``fadvise`` mode a
    readahead would cache pages past the entry a read drops (Note: [Spilled bytes leave RAM])."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)


def _drop_cached(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to drop the (clean) page-cache pages of ``[offset, offset + nbytes)`` of ``fd``."""
    os.posix_fadvise(fd, offset, round_up(nbytes, IO_ALIGN), os.POSIX_FADV_DONTNEED)


class ActivationSpillError(OSError):
    """Writing activations to the NVMe spill directory failed (e.g. ENOSPC). The spill files are removed."""


def check_dir(path: Any, option: str = "activation_nvme_dir") -> str:
    """``path`` (the value of ``option``: ``activation_nvme_dir`` or ``state_nvme_dir``) as an absolute path;
    ValueError naming the option unless it is an existing, writable directory (the files are created there); also
    checked by `LazyTrainingArguments`."""
    if not isinstance(path, str | os.PathLike) or not os.fspath(path):
        raise ValueError(
            f"{option}={path!r} must be the path of a directory on a fast local disk, e.g. "
            f"{option}='/scratch/lazytrain'."
        )
    resolved = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if os.path.exists(resolved) and not os.path.isdir(resolved):
        raise ValueError(
            f"{option}={path!r} is not a directory; pass a directory on a fast local disk for the spill files."
        )
    if not os.path.isdir(resolved):
        raise ValueError(
            f"{option}={path!r} does not exist; create it (mkdir -p {resolved}) or pass another directory on a fast "
            "local disk."
        )
    if not os.access(resolved, os.W_OK | os.X_OK):
        raise ValueError(
            f"{option}={path!r} is not writable by this process; fix its permissions or pass a directory you can "
            "write to."
        )
    return resolved


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


def remove_stale_spill_dirs(nvme_dir: str, pattern: re.Pattern = _SPILL_RE) -> list[str]:
    """Remove spill subdirectories under ``nvme_dir`` left by dead processes of this host; returns their paths.

    Note: [Spill files never outlive the process]
    Each engine spills into its own ``mkdtemp`` subdirectory (mode 0o700) named with this host, its pid and the
    process start time. Files are removed at `ActivationEngine.end_step`, on errors inside `ActivationEngine.step`, at
    `ActivationEngine.close`, when the engine is garbage-collected and at interpreter exit (a `weakref.finalize`,
    which runs through `atexit`, so SIGINT / KeyboardInterrupt and `sys.exit` clean up). A process killed with
    SIGKILL (or SIGTERM, which skips `atexit`) cannot clean up: the next engine constructed on the same directory
    removes the subdirectories whose owner no longer exists.

    ``pattern``: how the private directories are named (groups ``host``, ``pid``, ``start``); the training state on
    NVMe names its own (`lazytrain_hf.streaming.nvmestate`).
    """
    removed = []
    host = _host_id()
    try:
        names = os.listdir(nvme_dir)
    except OSError:
        return removed
    for name in names:
        m = pattern.match(name)
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


class IOThreads:
    """A fixed set of daemon threads running submitted calls, each answered by a `concurrent.futures.Future`.

    Note: [Spill I/O threads never block exit]
        `ThreadPoolExecutor` starts its workers lazily inside `submit`, as non-daemon threads joined at interpreter
        exit. A KeyboardInterrupt (Ctrl-C) raised in the main thread while `Thread.start()` waits for a new worker
        to run leaves that worker outside the executor's bookkeeping, blocked on its queue: the interpreter's exit
        joins it for ever, before the exit handlers that remove the spill files run (seen as a training process
        that ignores Ctrl-C during a backward's first reloads). These threads are all started up front, are
        daemons, so nothing they do can keep the process alive, and `shutdown` (called by `SpillDir.cleanup`, also
        at exit, Note: [Spill files never outlive the process]) lets them finish the call in hand and joins them
        before any file is removed. Test: ``tests/test_activations_process.py``.

    Args:
        workers: number of threads (calls run in submission order on one thread).
        name: thread name prefix.
    """

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as e:  # re-raised by whoever waits on the future
                fut.set_exception(e)
            else:
                fut.set_result(result)

    def submit(self, fn: Any, *args: Any) -> Future:
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return fut

    def shutdown(self, cancel_futures: bool = False) -> None:
        """Stop the threads once they finished the calls in hand (and, unless ``cancel_futures``, the queued ones)."""
        if cancel_futures:
            pending = []
            with contextlib.suppress(queue.Empty):
                while True:
                    pending.append(self._queue.get_nowait())
            for item in pending:
                if item is not None:
                    item[0].cancel()
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            if t.ident is not None:  # started (a Ctrl-C during __init__ may have stopped the loop)
                t.join()


class SpillDir:
    """The private spill directory of one engine: files, background I/O pools, cleanup.

    Holds no reference to the engine, so a `weakref.finalize` on the engine can call `cleanup`.

    Args:
        root: the directory the private spill directory is made in.
        io_threads: reader threads.
        io_mode: ``"auto"`` (``direct`` where the filesystem accepts it, else ``fadvise``), or one of ``"direct"``,
            ``"fadvise"``, ``"buffered"`` (See Note: [Spilled bytes leave RAM]).
    """

    def __init__(self, root: str, io_threads: int, io_mode: str = "auto") -> None:
        if io_mode not in IO_MODES:
            raise ValueError(f"nvme_io={io_mode!r} is not one of {IO_MODES}; pass 'auto' unless comparing modes.")
        self.root = root
        self.io_threads = io_threads
        self.requested_io_mode = io_mode
        self.io_mode = ""  # decided when the directory is made
        self.io_reason = ""
        self.path: str | None = None
        self.files: dict[tuple[int, int], _SpillFile] = {}
        self.lock = threading.Lock()
        self.writer: IOThreads | None = None
        self.reader: IOThreads | None = None

    def ensure(self) -> str:
        with self.lock:
            if self.path is None:
                prefix = f"{_SPILL_PREFIX}{_host_id()}_{os.getpid()}_{_process_start_ticks(os.getpid())}_"
                self.path = tempfile.mkdtemp(prefix=prefix, dir=self.root)  # mode 0o700
                self.io_mode, self.io_reason = self._choose_io_mode(self.path)
            # Note: [Spill I/O threads never block exit]; made apart from the directory, so that an interrupted
            # start leaves nothing half made
            if self.writer is None:
                self.writer = IOThreads(1, "lazytrain-spill-w")
            if self.reader is None:
                self.reader = IOThreads(self.io_threads, "lazytrain-spill-r")
            return self.path

    def _choose_io_mode(self, path: str) -> tuple[str, str]:
        """``(mode, reason)`` for the spill files in ``path``; See Note: [Spilled bytes leave RAM]."""
        want = self.requested_io_mode
        has_fadvise = hasattr(os, "posix_fadvise") and hasattr(os, "fdatasync")
        if want == "buffered":
            return "buffered", "page-cache I/O as requested (nvme_io='buffered')"
        if want in ("auto", "direct"):
            why = probe_direct_io(path)
            if why is None:
                return "direct", "O_DIRECT with 4096-byte aligned buffers, offsets and sizes"
            if want == "direct":
                raise ValueError(
                    f"nvme_io='direct' but {why}; pass nvme_io='auto' (falls back to fdatasync + "
                    "posix_fadvise(DONTNEED)) or put activation_nvme_dir on a filesystem that supports O_DIRECT."
                )
            if has_fadvise:
                return "fadvise", f"{why}: write + fdatasync + posix_fadvise(DONTNEED), reads followed by DONTNEED"
            return "buffered", f"{why}, and posix_fadvise is missing: page-cache I/O"
        if not has_fadvise:
            raise ValueError("nvme_io='fadvise' needs os.posix_fadvise and os.fdatasync; pass nvme_io='auto'.")
        return "fadvise", "write + fdatasync + posix_fadvise(DONTNEED), reads followed by DONTNEED, as requested"

    @property
    def direct(self) -> bool:
        return self.io_mode == "direct"

    def file(self, step: int, layer: int) -> _SpillFile:
        path = self.ensure()
        with self.lock:
            f = self.files.get((step, layer))
            if f is None:
                p = os.path.join(path, f"step{step}_layer{layer:04d}.act")
                flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
                f = _SpillFile(p, os.open(p, flags, 0o600))
                if self.io_mode == "fadvise":
                    no_readahead(f.fd)
                self.files[(step, layer)] = f
            return f

    def reserve(self, f: _SpillFile, nbytes: int) -> int:
        """The file offset of a new entry of ``nbytes`` bytes: aligned to `IO_ALIGN`, so every entry starts on its
        own page (O_DIRECT needs it; the DONTNEED of one entry then never spans a neighbour's page)."""
        with self.lock:
            off = f.size
            f.size += round_up(nbytes, IO_ALIGN)
            f.live += 1
            return off

    # ------------------------------------------------------------------ I/O (background threads)
    def write(self, f: _SpillFile, region: torch.Tensor, nbytes: int, offset: int) -> None:
        """Write ``nbytes`` of the staging ``region`` (aligned, `tiers.aligned`) at ``offset`` so that they do not
        stay in the page cache. See Note: [Spilled bytes leave RAM]."""
        if self.direct:
            _pwrite_all(f.fd, _bytes_of(region[: round_up(nbytes, IO_ALIGN)]), offset)
            return
        _pwrite_all(f.fd, _bytes_of(region[:nbytes]), offset)
        if self.io_mode == "fadvise":
            os.fdatasync(f.fd)  # DONTNEED drops clean pages only
            _drop_cached(f.fd, offset, nbytes)

    def read(self, f: _SpillFile, out: torch.Tensor, nbytes: int, offset: int) -> None:
        """Read ``nbytes`` at ``offset`` into ``out`` (in ``direct`` mode an aligned region of
        ``round_up(nbytes, IO_ALIGN)`` bytes; otherwise any ``nbytes`` bytes)."""
        if self.direct:
            _pread_all(f.fd, _bytes_of(out[: round_up(nbytes, IO_ALIGN)]), offset)
            return
        _pread_all(f.fd, _bytes_of(out[:nbytes]), offset)
        if self.io_mode == "fadvise":
            _drop_cached(f.fd, offset, nbytes)

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
                pool.shutdown(cancel_futures=True)
        self.writer = self.reader = None
        self.remove_all_files()
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


class NvmeTier(Tier):
    """``nvme``: staged through a pooled host buffer, written to the layer's spill file by one ordered writer,
    read back by the reader pool when the reload is issued.

    Args:
        ctx: the shared `TierContext`.
        nvme_dir: the directory the engine's private spill directory is made in.
        io_threads: reader threads.
        max_inflight_bytes: staging bytes of writes in flight before a store waits for the oldest write.
        io_mode: how the spill files are written and read (`SpillDir`; See Note: [Spilled bytes leave RAM]).
    """

    name = "nvme"

    def __init__(
        self, ctx: TierContext, nvme_dir: str, io_threads: int, max_inflight_bytes: int, io_mode: str = "auto"
    ) -> None:
        super().__init__(ctx)
        self.nvme_dir = nvme_dir
        self.max_inflight_bytes = int(max_inflight_bytes)
        self.spill = SpillDir(nvme_dir, io_threads, io_mode)
        self.step = 0  # names this step's files
        self._writes: deque[tuple[Future, int]] = deque()  # writes in flight: (future, staging bytes)
        self._reads: deque[Future] = deque()  # reads issued
        self._write_failure: tuple[OSError, int, int] | None = None  # (error, bytes attempted, layer)
        # the simulated spill writer and reader stall independently (Note: [Every background worker stalls for longer
        # than a forward] in lazytrain_hf/streams.py)
        sim = ctx.is_async and ctx.device.type == "cpu"
        self._io_delay = streams.SimDelay("nvme-read") if sim else None
        self._write_delay = streams.SimDelay("nvme-write") if sim else None

    # ------------------------------------------------------------------ store: stage, then write
    def store(self, layer: int, t: torch.Tensor, layout: Layout) -> Entry:
        # staged at an IO_ALIGN-aligned address in every mode (the mode is known once the directory exists)
        entry, staging, region = self._copy_off_device(layer, t, layout, align=IO_ALIGN)
        self._submit_write(entry, staging, region)
        return entry

    def _submit_write(self, entry: Entry, staging: torch.Tensor, region: torch.Tensor) -> None:
        spill, acct, pool = self.spill, self.ctx.acct, self.ctx.pool
        nbytes = entry.layout.nbytes
        f = spill.file(self.step, entry.layer)
        entry.file = f
        entry.offset = spill.reserve(f, nbytes)
        acct.add("nvme", nbytes)
        self.ctx.record("nvme_write", nbytes, None, entry.layer, "spill")
        # bound the staging memory of writes in flight: wait for the oldest ones first
        inflight = sum(n for _, n in self._writes)
        while self._writes and inflight + nbytes > self.max_inflight_bytes:
            self.ctx.host_sync("activations: nvme staging bound reached, waiting for the oldest spill write")
            fut, n = self._writes.popleft()
            with contextlib.suppress(Exception):
                fut.result()
            inflight -= n
        while self._writes and self._writes[0][0].done():
            self._writes.popleft()
        event = entry.copy_event
        layer = entry.layer
        failure = self._record_write_failure
        delay = self._write_delay

        def write() -> None:
            try:
                if delay is not None:
                    delay.sleep()
                if event is not None:
                    event.synchronize()  # the D2H copy into the pinned staging buffer
                spill.write(f, region, nbytes, entry.offset)
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

    def raise_write_failure(self) -> None:
        """Raise a failed write as `ActivationSpillError` on the calling thread, after removing the spill files."""
        failure = self._write_failure
        if failure is None:
            return
        e, nbytes, layer = failure
        self._write_failure = None
        # wait for the other writes and reads, then remove every spill file of the step before raising
        self.wait_io()
        self.spill.remove_all_files()
        free = shutil.disk_usage(self.nvme_dir).free if os.path.isdir(self.nvme_dir) else 0
        raise ActivationSpillError(
            e.errno,
            f"activation_nvme_dir={self.nvme_dir!r}: writing {nbytes} bytes ({format_bytes(nbytes)}) of layer "
            f"{layer}'s activations failed: {e.strerror or e} ({free} bytes free). The spill files were removed. Free "
            "space there, point activation_nvme_dir at a larger disk, or plan fewer layers with offload_nvme.",
        )

    # ------------------------------------------------------------------ reload: read back
    def _issue_reload(self, entry: Entry, storage: torch.Tensor, narrow: torch.Tensor) -> None:
        ctx = self.ctx
        alloc_event = ctx.lanes.compute_event() if ctx.is_async else None
        # the read, then the H2D copy of what it read (on the synchronous CPU engine a dense read lands in the
        # device tensor directly; it is recorded as the copy the CUDA path makes)
        ctx.record("nvme_read", entry.layout.nbytes, None, entry.layer, "unspill")
        ctx.record("h2d", entry.layout.nbytes, None, entry.layer, "reload")
        entry.reload_future = self.spill.reader.submit(self._read, entry, narrow, storage, alloc_event)
        with ctx.acct.lock:
            while self._reads and self._reads[0].done():
                self._reads.popleft()
            self._reads.append(entry.reload_future)

    def _read(self, entry: Entry, narrow: torch.Tensor, storage: torch.Tensor, alloc_event: Any) -> Any:
        """Background reader: spill file -> device tensor. Returns the lane event of the H2D copy (None when
        synchronous)."""
        ctx, spill = self.ctx, self.spill
        layout, f = entry.layout, entry.file
        nbytes = layout.nbytes
        entry.write_future.result()  # reads follow the write of the same bytes
        if self._io_delay is not None:
            self._io_delay.sleep()
        if not ctx.is_async and layout.dense and not spill.direct:
            spill.read(f, layout.landing_bytes(storage), nbytes, entry.offset)  # lands in place
            return None
        # O_DIRECT reads whole aligned blocks into an aligned buffer: through staging, as on CUDA
        staging = ctx.pool.get(round_up(nbytes, IO_ALIGN) + IO_ALIGN)
        region = aligned(staging, nbytes, IO_ALIGN)
        spill.read(f, region, nbytes, entry.offset)
        if not ctx.is_async:
            narrow.copy_(layout.host_view(region))
            ctx.pool.put(staging)
            return None
        # See Note: [H2D waits for the block's previous users]
        ev = ctx.lanes["h2d"].copy(narrow, layout.host_view(region), after=(alloc_event,))
        ctx.pool.put(staging, ev)  # See Note: [Pool buffers carry their last copy]
        return ev

    def materialize(self, entry: Entry) -> torch.Tensor:
        if entry.released:
            raise self._released_error(entry)
        self.prefetch(entry)
        fut = entry.reload_future
        if fut is not None:
            if not fut.done():
                self.ctx.host_sync("activations: unpack waits for an NVMe read")
            try:
                ev = fut.result()
            except OSError as e:
                self.raise_write_failure()
                raise OSError(
                    e.errno, f"reading layer {entry.layer}'s activations back from {self.spill.path!r} failed: {e}"
                ) from e
            entry.reload_future = None
            entry.reload_event = ev
        return self._wait_reload(entry)

    def release(self, entry: Entry) -> None:
        if not self._release_reload(entry):
            return
        with self.ctx.acct.lock:
            if entry.file is None:
                return
            self.ctx.acct.add("nvme", -entry.layout.nbytes)
            f, entry.file = entry.file, None
        # Note: [A spill file outlives its writes]: an entry released before its write ran (a graph freed without
        # backward, e.g. a forward interrupted by Ctrl-C) drops its file only once the write finished; closing the
        # descriptor under the writer failed the write with EBADF, or sent it to a file that reused the descriptor
        fut = entry.write_future
        if fut is not None and not fut.done():
            fut.add_done_callback(lambda _: self.spill.drop(f))
        else:
            self.spill.drop(f)

    # ------------------------------------------------------------------ step
    def wait_io(self) -> None:
        """Wait for every write and read in flight (before files are closed: their fds must stay valid)."""
        if self._writes or self._reads:
            self.ctx.host_sync("activations: waiting for every spill write and read in flight")
        for fut, _ in list(self._writes):
            with contextlib.suppress(Exception):
                fut.result()
        self._writes.clear()
        with self.ctx.acct.lock:
            reads = list(self._reads)
            self._reads.clear()
        for fut in reads:
            with contextlib.suppress(Exception):
                fut.result()

    def wait_writes(self) -> None:
        for fut, _ in list(self._writes):
            with contextlib.suppress(Exception):
                fut.result()
        self._writes.clear()

    def end_step(self, raise_errors: bool) -> None:
        """Remove this step's files; raise a pending write failure when ``raise_errors``."""
        self.spill.remove_all_files()
        self.step += 1
        failure, self._write_failure = self._write_failure, None
        if failure is not None and raise_errors:
            self._write_failure = failure
            self.raise_write_failure()
