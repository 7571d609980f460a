"""The node's compute copy: one shared-memory segment per node that every local rank maps, fetches read from and
the owners of the units (`lazytrain_hf.planner.world.unit_owners`) write into, with a version counter per unit.

With data parallelism the compute copy that fetches read lives once per node (Note: [The training state is
partitioned by unit] in lazytrain_hf/planner/world.py): a unit's owner writes the new compute copy of its unit into
the node's segment and publishes the unit's new version; a rank on another node writes what it received by the
all-gather and publishes it the same way. A rank fetches a unit only after `NodeCopy.wait` saw the version of the
update it needs (Note: [Update before fetch], across ranks).

A `NodeCopy` holds, in one POSIX shared-memory segment (a file of ``/dev/shm``, mapped ``MAP_SHARED``):

- a control region: a header, a process-shared robust mutex, one record per local rank (its pid, the start time of
  its process, its global rank, its state: attached, closed or failed, and the failure message) and one int64
  version per unit (how many optimizer updates of the unit have landed);
- a data region of ``data_nbytes`` bytes at a page boundary, carved into aligned views (`NodeCopy.carve`, offsets as
  the host store's: `ALIGN_BYTES`), page-locked in place when ``pin`` (on CUDA with ``cudaHostRegister``; under the
  simulated engine in the registry alone, so lane copies from it pass the pinned check:
  `lazytrain_hf.pinned.REGISTRY`).

Note: [The node copy is unlinked once every local rank mapped it]
    Local rank 0 creates the segment under a temporary name, sizes it with ``posix_fallocate`` (a full ``/dev/shm``
    fails here with a message, not later with SIGBUS), writes the header and links it to its name
    (`segment_name`: the run id and the node index, so two nodes on one machine never share one). After the first
    barrier the other local ranks map it and record their pid; after the second barrier every local rank unlinks
    the name (the first to do it wins, the others find it gone). From then on the memory belongs to the mappings
    alone and goes with the last process that maps it, however it exits, SIGKILL included. Before that point the
    name is removed by the creator on every exception (`NodeCopy.close` and the object's finalizer too); a creator
    killed inside the window leaves a name whose creator is dead: a local rank that mapped it removes it when its
    own open fails, and the next creation of the same name removes it before it creates its own. Temporary names of
    a killed creator (``<name>.<pid>.tmp``) are removed the same way. What is left outside these paths is a creator
    SIGKILLed while no other process of the node maps the segment and no run with that name starts again.

Note: [A unit's version is published after its data]
    The writer of a unit stores its bytes in the data region, then `NodeCopy.publish` stores the new version; a
    reader that `NodeCopy.wait` saw reach that version then reads (or lets a copy lane read) the bytes. Both sides
    take the segment's process-shared mutex around the counter (``pthread_mutex_lock`` / ``unlock``: acquire and
    release barriers on every platform), so everything the writer stored before its ``unlock`` is visible to the
    reader after its ``lock``. Plain program order would be enough on x86-64 (TSO: stores become visible in order),
    not on aarch64 (Grace Hopper), where stores may become visible out of order without a barrier, and Python offers
    no fence of its own. Bytes written by a copy lane (a D2H copy, a reload) must have landed before ``publish``:
    the writer synchronises the copy's event first. The reverse order, a unit rewritten only after every rank's
    fetches of its previous version are done (Note: [Host compute copy is not rewritten while a fetch reads it]),
    needs no counter: the owner updates a unit only with its reduced gradient, which exists only after every rank
    ran the unit's backward, the last use of the fetched copy in the step.

Failures: a rank that catches an exception marks itself failed (`NodeCopy.mark_failed`, or the ``with`` block);
`NodeCopy.wait` and `NodeCopy.check_peers` raise `RankFailedError` naming every local rank that failed or died (its
process gone, a zombie, or its pid reused by another process: the recorded start time differs), and a wait raises
`WaitTimeoutError` after `dp_timeout_s` seconds (``LAZYTRAIN_DP_TIMEOUT_S``, else ``ddp_timeout`` under LazyTrainer),
naming the rank it waited for, the unit and the timeout. Ranks of other nodes are seen only through the timeout (and
the collective that failed with them).
Local ranks in separate PID namespaces cannot see each other's pids: run the ranks of a node in one.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import math
import mmap
import os
import re
import time
import weakref
from collections.abc import Callable
from contextlib import contextmanager

import torch

from ..pinned import PAGE, REGISTRY, Registration
from ..planner.layouts import align_up
from ..planner.world import World

SHM_DIR = "/dev/shm"
TIMEOUT_ENV = "LAZYTRAIN_DP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_MAGIC = int.from_bytes(b"LZTNODE1", "little")
# header: int64 slots at the start of the segment
_H_MAGIC, _H_TOTAL, _H_DATA_OFF, _H_DATA_BYTES, _H_UNITS, _H_LOCAL_WORLD, _H_CREATOR_PID, _H_CREATOR_START = range(8)
_MUTEX_OFF, _MUTEX_BYTES = 128, 128  # pthread_mutex_t is 40 bytes (glibc x86-64), 48 (glibc aarch64)
_RANKS_OFF = _MUTEX_OFF + _MUTEX_BYTES
_RANK_BYTES = 256  # pid, start time, global rank, state (int64 each), then the failure message
_MSG_OFF, _MSG_BYTES = 32, _RANK_BYTES - 32
_EMPTY, _ATTACHED, _CLOSED, _FAILED = 0, 1, 2, 3
# wait(): polling interval (doubling from the first to the last), and how often peers' liveness is read
_POLL_FIRST_S, _POLL_MAX_S, _LIVENESS_EVERY_S = 50e-6, 1e-3, 0.05

_libc = ctypes.CDLL(None, use_errno=True)


class NodeCopyError(RuntimeError):
    """The node's shared compute copy could not be created, mapped or used."""


class RankFailedError(NodeCopyError):
    """A local rank failed (marked itself failed) or died; ``ranks`` maps each such global rank to what happened."""

    def __init__(self, message: str, ranks: dict[int, str]):
        super().__init__(message)
        self.ranks = ranks


class WaitTimeoutError(NodeCopyError, TimeoutError):
    """`NodeCopy.wait` gave up after its timeout; ``rank``: the rank whose update did not land, ``unit``: the unit."""

    def __init__(self, message: str, rank: int, unit: int):
        super().__init__(message)
        self.rank = rank
        self.unit = unit


# The timeout while LAZYTRAIN_DP_TIMEOUT_S is unset and the setting it comes from (`set_timeout_default`; LazyTrainer
# sets TrainingArguments.ddp_timeout at train(): Note: [One timeout for the ranks' collectives] in
# training/partitions.py). One distributed world per process, so one value per process.
_default_timeout: tuple[float, str] = (DEFAULT_TIMEOUT_S, TIMEOUT_ENV)


def set_timeout_default(seconds: float, setting: str) -> None:
    """Make ``seconds`` what `dp_timeout_s` returns while ``LAZYTRAIN_DP_TIMEOUT_S`` is unset; ``setting``: the option
    it comes from, which the timeout messages name as the one to raise (e.g. ``"ddp_timeout"``)."""
    value = float(seconds)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{setting}={seconds!r} must be a positive number of seconds (e.g. 1800).")
    global _default_timeout
    _default_timeout = (value, str(setting))


def timeout_setting() -> str:
    """The option `dp_timeout_s` takes its value from: ``LAZYTRAIN_DP_TIMEOUT_S`` when set, else the setting given to
    `set_timeout_default` (``LAZYTRAIN_DP_TIMEOUT_S`` when none was)."""
    return TIMEOUT_ENV if os.environ.get(TIMEOUT_ENV, "").strip() else _default_timeout[1]


def dp_timeout_s() -> float:
    """Seconds a rank waits for another rank: ``LAZYTRAIN_DP_TIMEOUT_S`` when set, else the default of
    `set_timeout_default` (LazyTrainer: ``TrainingArguments.ddp_timeout``), else `DEFAULT_TIMEOUT_S`."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return _default_timeout[0]
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds (e.g. {DEFAULT_TIMEOUT_S:g}): how long a "
            "data-parallel rank waits for another rank's update before it raises."
        )
    return value


def segment_name(run_id: str, node: int) -> str:
    """The shared-memory name of node ``node``'s compute copy in run ``run_id`` (a file of `SHM_DIR`)."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id):
        raise ValueError(
            f"run_id={run_id!r} must be 1-128 characters of letters, digits, '.', '_' or '-' (it names the "
            "shared-memory segment): pass e.g. the torch.distributed.run rendezvous id with other characters removed."
        )
    if int(node) < 0:
        raise ValueError(f"node={node} must be >= 0.")
    return f"lazytrain-{run_id}-node{int(node)}"


def _proc_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), 0 where ``/proc`` cannot tell, None if it is gone
    or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _alive(pid: int, start: int) -> bool:
    now = _proc_start(pid)
    return now is not None and (start == 0 or now == 0 or now == start)


def _layout(data_nbytes: int, num_units: int, local_world: int) -> tuple[int, int, int]:
    """``(versions offset, data offset, total bytes)`` of a segment."""
    versions = _RANKS_OFF + local_world * _RANK_BYTES
    data = align_up(versions + 8 * num_units, PAGE)
    return versions, data, data + align_up(max(1, data_nbytes), PAGE)


class _Segment:
    """The mapping and what must go with it: the name while it is linked, the registration of the data region."""

    def __init__(self, path: str):
        self.path = path
        self.named = False  # this process created the name and has not unlinked it yet
        self.mm: mmap.mmap | None = None
        self.ints: memoryview | None = None
        self.mutex: ctypes.c_char | None = None
        self.data: torch.Tensor | None = None
        self.private: torch.Tensor | None = None  # the data region, mapped copy-on-write (`NodeCopy.private_view`)
        self.registration: Registration | None = None

    def map(self, fd: int, total: int, control_bytes: int, data_off: int, data_nbytes: int) -> None:
        self.mm = mmap.mmap(fd, total)
        self.ints = memoryview(self.mm)[:control_bytes].cast("q")
        self.mutex = ctypes.c_char.from_buffer(self.mm, _MUTEX_OFF)
        if data_nbytes:  # address space only until read: Note: [Parameters given back share the node copy]
            cow = mmap.mmap(fd, total - data_off, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE, offset=data_off)
            self.private = torch.frombuffer(cow, dtype=torch.uint8, count=data_nbytes)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.named = False

    def release(self) -> None:
        """Unregister the data region, then drop the mapping (unmapped once no view of it is left); remove the name
        if this process created it and it is still linked (Note: [Unregister before free] in lazytrain_hf/pinned.py,
        Note: [The node copy is unlinked once every local rank mapped it])."""
        if self.registration is not None:
            REGISTRY.unregister(self.registration)
            self.registration = None
        if self.named:
            self.unlink()
        self.data = self.private = None
        self.mutex = None
        if self.ints is not None:
            self.ints.release()
            self.ints = None
        self.mm = None


def _pthread(fn: str, *args) -> int:
    return int(getattr(_libc, fn)(*args))


class NodeCopy:
    """This rank's mapping of its node's compute copy (see the module docstring).

    Args:
        run_id: names the segment with the node index (`segment_name`); the same on every rank of the run, unique
            among the runs on a machine.
        world: the data-parallel `World`; ``rank``: this process's global rank (its node and local rank follow).
        data_nbytes: bytes of the data region (the compute copies of every unit, carved with `carve`).
        num_units: how many units have a version counter (unit indices ``0 .. num_units - 1``).
        barrier: blocks until every local rank of the node (or every rank) called it: a
            ``torch.distributed`` group barrier, or a ``multiprocessing`` barrier's ``wait``; called twice.
        pin: page-lock the data region (`lazytrain_hf.streams.pin_host_memory` of the device).
        what: names the region in registration errors.

    Every local rank passes the same ``run_id``, ``world``, ``data_nbytes`` and ``num_units``.
    """

    def __init__(
        self,
        run_id: str,
        world: World,
        rank: int,
        data_nbytes: int,
        num_units: int,
        barrier: Callable[[], object],
        pin: bool,
        what: str = "the node's compute copy",
    ):
        if not 0 <= int(rank) < world.world_size:
            raise ValueError(f"rank={rank} is outside the world of {world.world_size} ranks (0 .. world_size - 1).")
        if int(data_nbytes) < 0 or int(num_units) < 0:
            raise ValueError(f"data_nbytes={data_nbytes} and num_units={num_units} must be >= 0.")
        self.world, self.rank = world, int(rank)
        self.node, self.local_rank = world.node_of(self.rank), world.local_rank(self.rank)
        self.name = segment_name(run_id, self.node)
        self.data_nbytes, self.num_units = int(data_nbytes), int(num_units)
        self.used = 0
        self._versions_off, self._data_off, self._total = _layout(
            self.data_nbytes, self.num_units, world.local_world_size
        )
        self._seg = _Segment(os.path.join(SHM_DIR, self.name))
        self._finalizer = weakref.finalize(self, self._seg.release)
        self._closed = False
        try:
            if self.local_rank == 0:
                self._create()
            barrier()
            if self.local_rank != 0:
                self._attach()
            barrier()
            self._seg.unlink()  # Note: [The node copy is unlinked once every local rank mapped it]
            if self.data_nbytes:
                self._seg.data = torch.frombuffer(
                    self._seg.mm, dtype=torch.uint8, count=self.data_nbytes, offset=self._data_off
                )
            else:
                self._seg.data = torch.empty(0, dtype=torch.uint8)
            if pin and self.data_nbytes:
                self._seg.registration = REGISTRY.register(self._seg.data, what)
        except BaseException as e:
            if self._seg.ints is not None and self._record(self.local_rank)[0] == os.getpid():
                self.mark_failed(e)
            if self._seg.ints is not None and not self._seg.named and not self._creator_alive():
                self._seg.unlink()  # the creator died between creation and unlink: nobody else will remove it
            self._closed = True
            self._finalizer()
            raise

    # ------------------------------------------------------------------ creation and attachment
    def _create(self) -> None:
        path = self._seg.path
        self._remove_orphans()
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, self._total)
            except OSError as e:
                st = os.statvfs(SHM_DIR)
                raise NodeCopyError(
                    f"cannot size the shared-memory segment {path} to {self._total} bytes ({e.strerror}); {SHM_DIR} "
                    f"has {st.f_bavail * st.f_frsize} bytes free. Enlarge it (docker run --shm-size, or "
                    f"mount -o remount,size=... {SHM_DIR}) or plan for less host memory."
                ) from e
            self._seg.map(fd, self._total, self._versions_off + 8 * self.num_units, self._data_off, self.data_nbytes)
            ints = self._seg.ints
            pid, start = os.getpid(), _proc_start(os.getpid()) or 0
            for slot, value in (
                (_H_TOTAL, self._total),
                (_H_DATA_OFF, self._data_off),
                (_H_DATA_BYTES, self.data_nbytes),
                (_H_UNITS, self.num_units),
                (_H_LOCAL_WORLD, self.world.local_world_size),
                (_H_CREATOR_PID, pid),
                (_H_CREATOR_START, start),
            ):
                ints[slot] = value
            self._init_mutex()
            self._set_record(pid, start, _ATTACHED)
            ints[_H_MAGIC] = _MAGIC
            try:
                os.link(tmp, path)
            except FileExistsError:
                if not self._remove_if_orphaned(path):
                    raise NodeCopyError(self._taken_message(path)) from None
                os.link(tmp, path)
            self._seg.named = True
        finally:
            os.close(fd)
            os.unlink(tmp)

    def _init_mutex(self) -> None:
        attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t: 4 bytes on glibc and musl
        mutex = ctypes.byref(self._seg.mutex)
        for fn, args in (
            ("pthread_mutexattr_init", (attr,)),
            ("pthread_mutexattr_setpshared", (attr, 1)),  # PTHREAD_PROCESS_SHARED
            ("pthread_mutexattr_setrobust", (attr, 1)),  # PTHREAD_MUTEX_ROBUST: a killed holder does not block
            ("pthread_mutexattr_settype", (attr, 2)),  # PTHREAD_MUTEX_ERRORCHECK: relocking raises, not hangs
            ("pthread_mutex_init", (mutex, attr)),
            ("pthread_mutexattr_destroy", (attr,)),
        ):
            err = _pthread(fn, *args)
            if err:
                raise NodeCopyError(f"{fn} failed: {os.strerror(err)}")

    def _attach(self) -> None:
        path = self._seg.path
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise NodeCopyError(
                f"rank {self.rank} (local rank {self.local_rank}) found no shared-memory segment {path}: local rank 0 "
                "of the node creates it before the first barrier, so it failed or exited since, or the ranks were "
                "given different run_id or world (pass the same on every rank, and a barrier over the node's ranks)."
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size != self._total:
                raise NodeCopyError(
                    f"the shared-memory segment {path} has {size} bytes, rank {self.rank} expects {self._total} "
                    f"(data_nbytes={self.data_nbytes}, num_units={self.num_units}, local world "
                    f"{self.world.local_world_size}): every rank must pass the same sizes."
                )
            self._seg.map(fd, size, self._versions_off + 8 * self.num_units, self._data_off, self.data_nbytes)
        finally:
            os.close(fd)
        ints = self._seg.ints
        got = (ints[_H_MAGIC], ints[_H_DATA_BYTES], ints[_H_UNITS], ints[_H_LOCAL_WORLD])
        want = (_MAGIC, self.data_nbytes, self.num_units, self.world.local_world_size)
        if got != want:
            raise NodeCopyError(
                f"the shared-memory segment {path} holds (magic, data_nbytes, num_units, local world) = {got[1:]}, "
                f"rank {self.rank} expects {want[1:]}: every rank must pass the same sizes and world."
            )
        pid = self._record(self.local_rank)[0]
        if pid:
            raise NodeCopyError(
                f"local rank {self.local_rank} of node {self.node} is already attached by pid {pid}: two processes "
                "were given the same rank."
            )
        self._set_record(os.getpid(), _proc_start(os.getpid()) or 0, _ATTACHED)

    def _remove_orphans(self) -> None:
        """Remove this name, and temporary names of it, left by creators that died (Note: [The node copy is unlinked
        once every local rank mapped it])."""
        self._remove_if_orphaned(self._seg.path)
        for tmp in glob.glob(glob.escape(self._seg.path) + ".*.tmp"):
            pid = tmp.rsplit(".", 2)[-2]
            if pid.isdigit() and _proc_start(int(pid)) is None:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass

    @staticmethod
    def _creator_of(path: str) -> tuple[int, int] | None:
        """``(pid, start)`` of the creator recorded in segment ``path``; None if it has no header."""
        try:
            with open(path, "rb") as f:
                head = f.read(8 * (_H_CREATOR_START + 1))
        except FileNotFoundError:
            return None
        ints = memoryview(head).cast("q") if len(head) == 8 * (_H_CREATOR_START + 1) else None
        if ints is None or ints[_H_MAGIC] != _MAGIC:
            return None
        return ints[_H_CREATOR_PID], ints[_H_CREATOR_START]

    def _remove_if_orphaned(self, path: str) -> bool:
        creator = self._creator_of(path)
        if creator is None or _alive(*creator):
            return not os.path.exists(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return True

    def _taken_message(self, path: str) -> str:
        creator = self._creator_of(path)
        who = f"process {creator[0]}" if creator else "a process that did not finish creating it"
        return (
            f"the shared-memory segment {path} exists and belongs to {who}, still alive: another run uses run_id and "
            f"node {self.node} on this machine. Give each run its own run_id."
        )

    def _creator_alive(self) -> bool:
        ints = self._seg.ints
        return ints[_H_MAGIC] != _MAGIC or _alive(ints[_H_CREATOR_PID], ints[_H_CREATOR_START])

    # ------------------------------------------------------------------ the control region
    @contextmanager
    def _locked(self):
        """The segment's mutex (Note: [A unit's version is published after its data])."""
        if self._seg.mutex is None:
            raise NodeCopyError(f"the node copy {self.name} of rank {self.rank} is closed.")
        mutex = ctypes.byref(self._seg.mutex)  # never taken twice by one thread (EDEADLK: it is not recursive)
        err = _pthread("pthread_mutex_lock", mutex)
        if err == errno.EOWNERDEAD:  # its holder died; the counters it guards are single stores: still whole
            err = _pthread("pthread_mutex_consistent", mutex)
        if err:
            raise NodeCopyError(f"pthread_mutex_lock of {self.name} failed: {os.strerror(err)}")
        try:
            yield self._seg.ints
        finally:
            _pthread("pthread_mutex_unlock", mutex)

    def _record(self, local_rank: int) -> tuple[int, int, int, int]:
        """``(pid, start, rank, state)`` of a local rank (read without the mutex: callers take it where it matters)."""
        base = (_RANKS_OFF + local_rank * _RANK_BYTES) // 8
        ints = self._seg.ints
        return ints[base], ints[base + 1], ints[base + 2], ints[base + 3]

    def _message(self, local_rank: int) -> str:
        off = _RANKS_OFF + local_rank * _RANK_BYTES + _MSG_OFF
        return bytes(self._seg.mm[off : off + _MSG_BYTES]).rstrip(b"\0").decode("utf-8", "replace")

    def _set_record(self, pid: int, start: int, state: int, message: str = "") -> None:
        base = (_RANKS_OFF + self.local_rank * _RANK_BYTES) // 8
        ints = self._seg.ints
        ints[base], ints[base + 1], ints[base + 2], ints[base + 3] = pid, start, self.rank, state
        off = _RANKS_OFF + self.local_rank * _RANK_BYTES + _MSG_OFF
        raw = message.encode("utf-8")[: _MSG_BYTES - 1]
        self._seg.mm[off : off + _MSG_BYTES] = raw + b"\0" * (_MSG_BYTES - len(raw))

    def _check_unit(self, unit: int) -> int:
        if not 0 <= int(unit) < self.num_units:
            raise ValueError(f"unit={unit} is outside the node copy's {self.num_units} units (0 .. num_units - 1).")
        return self._versions_off // 8 + int(unit)

    # ------------------------------------------------------------------ the data region
    @property
    def data(self) -> torch.Tensor:
        """The whole data region (uint8, ``data_nbytes``)."""
        if self._seg.data is None:
            raise NodeCopyError(f"the node copy {self.name} of rank {self.rank} is closed.")
        return self._seg.data

    @property
    def pinned(self) -> bool:
        return self._seg.registration is not None and self._seg.registration.active

    def carve(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A view of ``n`` elements of ``dtype`` at the next `ALIGN_BYTES` boundary of the data region (as
        `lazytrain_hf.streaming.store.PinnedArena.carve`, but not zeroed: the segment starts zeroed, and another rank
        may have written it already). Every local rank carves the same sequence, so views match across ranks."""
        start = align_up(self.used)
        nbytes = int(n) * dtype.itemsize
        if start + nbytes > self.data_nbytes:
            raise ValueError(
                f"the node copy {self.name} of {self.data_nbytes} bytes cannot hold {nbytes} more bytes at offset "
                f"{start}: size data_nbytes for every unit's compute copy (each at an ALIGN_BYTES boundary)."
            )
        self.used = start + nbytes
        return self.data.narrow(0, start, nbytes).view(dtype)

    def private_view(self, t: torch.Tensor) -> torch.Tensor | None:
        """The bytes of ``t`` (a contiguous view of `data`) in this rank's copy-on-write mapping of the data region,
        as a tensor of ``t``'s dtype and shape that outlives `close`; None when ``t`` is not in the data region.
        Note: [Parameters given back share the node copy] in streaming/binder.py."""
        private, data = self._seg.private, self._seg.data
        if private is None or data is None or not t.is_contiguous():
            return None
        start, nbytes = t.data_ptr() - data.data_ptr(), t.numel() * t.element_size()
        if not 0 <= start <= self.data_nbytes - nbytes:
            return None
        return private.narrow(0, start, nbytes).view(t.dtype).view(t.shape)

    # ------------------------------------------------------------------ versions
    def version(self, unit: int) -> int:
        """How many updates of ``unit`` have landed in the node copy."""
        slot = self._check_unit(unit)
        with self._locked() as ints:
            return ints[slot]

    def publish(self, unit: int, version: int) -> None:
        """Make ``version`` of ``unit`` visible to every local rank, after its bytes were written (Note: [A unit's
        version is published after its data]): a lane copy that wrote them must have completed."""
        slot = self._check_unit(unit)
        with self._locked() as ints:
            if int(version) < ints[slot]:
                raise ValueError(
                    f"publish(unit={unit}, version={version}) by rank {self.rank}: the unit is already at version "
                    f"{ints[slot]}; versions only grow (one per optimizer update of the unit)."
                )
            ints[slot] = int(version)

    def wait(self, unit: int, version: int, owner_rank: int, timeout_s: float | None = None) -> None:
        """Return once ``unit`` reached ``version``; ``owner_rank`` publishes it (a rank of this node, or of another
        node whose update an all-gather brings). Polls with sleeps of 50 us to 1 ms. Raises `RankFailedError` when
        a local rank failed or died (the owner, or a rank that closed before publishing), `WaitTimeoutError` after
        ``timeout_s`` seconds (default: `dp_timeout_s`)."""
        slot = self._check_unit(unit)
        timeout = dp_timeout_s() if timeout_s is None else float(timeout_s)
        if not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(
                f"timeout_s={timeout_s} must be a positive number of seconds (e.g. {DEFAULT_TIMEOUT_S:g})."
            )
        with self._locked() as ints:
            now_at = ints[slot]
        if now_at >= version:
            return
        if not 0 <= int(owner_rank) < self.world.world_size:
            raise ValueError(
                f"wait(unit={unit}, version={version}): owner_rank={owner_rank} is not a rank of the world of "
                f"{self.world.world_size}, and the unit is at version {now_at}: only a unit's owner publishes it."
            )
        start = time.monotonic()
        deadline, next_check, pause = start + timeout, start, _POLL_FIRST_S
        while True:
            now = time.monotonic()
            if now >= next_check:
                self._check_for_wait(unit, version, int(owner_rank), now_at)
                next_check = now + _LIVENESS_EVERY_S
            if now >= deadline:
                raise WaitTimeoutError(
                    self._timeout_message(unit, version, int(owner_rank), now_at, timeout), int(owner_rank), int(unit)
                )
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)
            with self._locked() as ints:
                now_at = ints[slot]
            if now_at >= version:
                return

    def _where(self, rank: int) -> str:
        if self.world.node_of(rank) != self.node:
            return f"on node {self.world.node_of(rank)}; its update arrives by the all-gather"
        pid = self._record(self.world.local_rank(rank))[0]
        return f"local rank {self.world.local_rank(rank)} of node {self.node}, pid {pid}"

    def _check_for_wait(self, unit: int, version: int, owner: int, now_at: int) -> None:
        failed = self.dead_ranks()
        if self.world.node_of(owner) == self.node:
            pid, _, _, state = self._record(self.world.local_rank(owner))
            if state == _CLOSED and owner not in failed:
                failed[owner] = f"closed its node copy (pid {pid}) before publishing"
        if failed:
            raise RankFailedError(
                f"rank {self.rank} waited for unit {unit} to reach version {version} (it is at {now_at}; published "
                f"by rank {owner}, {self._where(owner)}), but " + self._failed_text(failed, first=owner),
                failed,
            )

    def _timeout_message(self, unit: int, version: int, owner: int, now_at: int, timeout: float) -> str:
        return (
            f"rank {self.rank} waited {timeout:g} s for unit {unit} to reach version {version} (it is at {now_at}); "
            f"rank {owner} publishes it ({self._where(owner)}) and no local rank failed. Look for the cause in rank "
            f"{owner}'s log; if an update can take this long, raise {timeout_setting()} (seconds, now {timeout:g})."
        )

    @staticmethod
    def _failed_text(failed: dict[int, str], first: int | None = None) -> str:
        order = sorted(failed, key=lambda r: (r != first, r))
        return "; ".join(f"rank {r} {failed[r]}" for r in order) + "."

    # ------------------------------------------------------------------ failures
    def mark_failed(self, error: BaseException | str) -> None:
        """Mark this rank failed in the control region, with ``error``'s type and message (what the other local
        ranks' waits then name)."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if self._seg.ints is None:
            return
        with self._locked():
            self._set_record(os.getpid(), _proc_start(os.getpid()) or 0, _FAILED, text)

    def dead_ranks(self) -> dict[int, str]:
        """The other local ranks that failed or died, global rank -> what happened (closed ranks are not dead)."""
        out = {}
        with self._locked():
            records = [(lr, self._record(lr), self._message(lr)) for lr in range(self.world.local_world_size)]
        for lr, (pid, start, rank, state), msg in records:
            if lr == self.local_rank or state in (_EMPTY, _CLOSED):
                continue
            if state == _FAILED:
                out[rank] = f"failed (local rank {lr}, pid {pid}): {msg}"
            elif not _alive(pid, start):
                out[rank] = f"died (local rank {lr}, pid {pid}: no such process, a zombie, or its pid was reused)"
        return out

    def check_peers(self) -> None:
        """Raise `RankFailedError` naming every other local rank that failed or died."""
        failed = self.dead_ranks()
        if failed:
            raise RankFailedError(f"on node {self.node} (rank {self.rank}): " + self._failed_text(failed), failed)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Record this rank as closed (unless it failed), unregister the data region and drop the mapping (views
        handed out keep the memory, unpinned); removes the name if it is still linked."""
        if self._closed:
            return
        self._closed = True
        if self._seg.ints is not None:
            with self._locked():
                if self._record(self.local_rank)[3] != _FAILED:
                    self._set_record(os.getpid(), _proc_start(os.getpid()) or 0, _CLOSED)
        self._finalizer()

    def __enter__(self) -> NodeCopy:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and not self._closed:
            self.mark_failed(exc)
        self.close()

    def __repr__(self) -> str:
        return (
            f"NodeCopy(name={self.name!r}, rank={self.rank}, local_rank={self.local_rank}, "
            f"data_nbytes={self.data_nbytes}, num_units={self.num_units}, pinned={self.pinned})"
        )
