"""Training state of streamed units on NVMe: per-unit state files, chunked out-of-core optimizer step, crash safety.

A streamed unit (decoder layer, or the streamed embedding / head) listed in ``plan.state_nvme`` keeps none of its
training state in host RAM between uses. `NvmeState` owns one file per such unit in a private directory under
``state_nvme_dir``:

- ``compute``: the compute copy, laid out as the host store lays it out (`store.layer_layout`), the source of every
  weight fetch: a fetch reads it into a host window on the reader thread, which then issues the window's copy to
  the device slot (Note: [A fetch from NVMe is read off the step's threads]);
- ``grad``: the fp32 gradient accumulator (store layout). A completed backward's gradients land in a host window
  (`open_grad`; with gradient accumulation the window first reads the accumulated gradient), their norm is taken
  there, and the window is written back (`close_grad`);
- two generations of the optimizer state, per trainable parameter: fp32 master, and for 8-bit tensors the
  `Quantized8bit` codes and block scales of ``exp_avg`` and ``exp_avg_sq``. Tensors below ``min_8bit_size`` keep
  their fp32 moments in RAM (norms and biases: a few KB per layer). Each parameter's arrays start at `IO_ALIGN`
  and are padded to it, so chunks never share a block of the file.

Its parts live beside it: the chunked optimizer step (`stateupdate.ChunkedUpdate`, a base class of `NvmeState`), the
per-unit records and the host-window helpers (`statelayout.py`), the committed files read as data (`statefiles.py`),
the registered windows (`statewindows.py`); the byte sizes the planner predicts are `lazytrain_hf.planner.layouts`'.

Note: [The out-of-core optimizer step is chunked]
    `update_unit` runs a unit's AdamW step in chunks of `CHUNK_ELEMS` elements of one parameter (a multiple of
    every block size, so a chunk holds whole quantisation blocks and the kernel computes exactly what one pass over
    the whole tensor computes; every array offset stays `IO_ALIGN`-aligned). A reader thread loads chunks ``k + 1``
    and ``k + 2`` (master, gradient, codes, scales) while chunk ``k`` is updated and a writer thread writes chunks
    ``k - 1`` and ``k - 2`` back: five chunk windows, whatever the layer's size (`hostmem.STATE_CHUNK_WINDOWS`;
    two writes in flight keep the disk busy while a chunk is computed: `benchmarks/bench_state_io.py`). The compute copy is written into one unit-sized window
    (read first when the unit has frozen parameters) and written to the file when the unit is done. With
    ``optimizer_overlap`` this runs on the updater's background thread while the next forward runs, the forward
    of unit ``i`` waiting only for unit ``i``'s update (Note: [Update before fetch] in training/updater.py).
    Test: ``tests/test_state_nvme.py::test_state_on_nvme_bit_exact`` (losses and every weight bit for bit equal to
    the state in RAM, under plans, gradient accumulation and the simulated asynchronous engine).

Note: [The state on NVMe commits per optimizer step]
    The updates of step ``n`` write generation ``1 - g`` of each unit, never the generation ``g`` that holds step
    ``n - 1``; once every unit of the pass is written, the files are flushed (``fdatasync``) and ``manifest.json``
    (the committed step, and per unit its generation and per-parameter step counts) is replaced atomically
    (written to a temporary file, flushed, renamed). A process killed during the write-back leaves the manifest of
    step ``n - 1`` and that step's state intact: `read_committed` returns it bit for bit. The compute copy and the
    gradient are caches of the step in progress (rebuilt from the masters, resp. the next backward), not part of
    the committed state: after a pass that failed (ENOSPC), `StreamHandle.remove()` gives these units' parameters
    their committed masters, not the compute copies the pass may have rewritten. (Parameters kept in RAM, the
    resident ones, are updated first in a pass and are not rolled back.) Checkpoints are written from the committed state (`checkpoint_tensors`); a directory of a
    process that is gone is removed by the next run in the same ``state_nvme_dir``. Tests:
    ``tests/test_state_nvme.py::test_kill_during_write_back`` and ``::test_disk_full_during_write_back``.

Note: [A fetch from NVMe is read off the step's threads]
    A fetch of a unit on NVMe (`TransferEngine.copy_in_from_read`, from the scheduler's fetch path) only queues the
    read of the unit's compute copy on the reader thread and returns: the training thread (or the autograd thread,
    in backward) never waits for the disk when it issues a fetch, so a prefetch issued stages ahead overlaps
    compute. The reader reads into one of `STATE_FETCH_WINDOWS` registered fetch windows (`statewindows.FetchWindows`),
    then issues the window's H2D copy into the slot itself, ordered after the slot's release (Note: [Slot reuse waits
    for the compute event] in engine.py); the window is handed out again only once that copy completed (the reader
    waits for it when every window is in flight, never the step's threads). The slot's readiness is the reader's
    job and then its copy's event: `wait_ready` waits for the job (a host sync only when the read has not landed
    yet, counted in the trace) and makes the compute stream wait for the copy (Note: [Compute waits for the H2D
    event]); `release` of a slot whose fetch was never used waits for the job too, so the slot's next copy (or the
    free of a transient slot's buffer) follows this one. Under the simulation the reader's jobs are delayed and
    stall like every background worker's (``state-read``; Note: [Every background worker stalls for longer than a
    forward] in lazytrain_hf/streams.py). The reader and writer are daemon threads started with the state (Note:
    [Spill I/O threads never block exit] in activations/nvme.py). Tests:
    ``tests/test_cuda_semantics_host.py::test_state_nvme_fetch_is_read_off_the_training_thread`` (no read of a
    compute copy on the step's threads, gradients bit-exact), ``::test_state_nvme_fetch_windows_are_bounded``,
    ``::test_state_nvme_fetch_read_stalls_are_waited_for`` and ``::test_state_nvme_fetch_read_error_reaches_the_step``.

Note: [The state on NVMe works partitioned]
    In a data-parallel world (Note: [The training state is partitioned by unit] in planner/world.py) a rank's
    `NvmeState` holds the units it owns only (`StreamHandle`: ``plan.state_nvme`` & ``store.owned``); the compute
    copy of a unit another rank owns is in RAM (the node copy) and its fetches read nothing from NVMe. Per optimizer
    step of ``g`` micro-batches a rank reads from NVMe, for each unit it owns: the compute copy at each of its
    fetches (every micro-batch), the accumulated gradient before each of micro-batches ``2..g`` adds into it, the
    optimizer step's state (masters, gradient, moments: ``state_read``), and the updated compute copy once more,
    into the node copy (`PartitionedDataParallel.send_compute`). `lazytrain_hf.planner.schedule` predicts exactly
    that per rank (``node_copy``). Tests: ``tests/test_partitioned_state.py::test_state_on_nvme_is_read_by_its_owner_only``,
    ``tests/test_trainer_ddp.py::test_step_reduce_of_moe_units_with_streamed_embeddings_and_state_on_nvme_matches_one_process``
    and ``::test_partitioned_state_on_nvme_matches_one_process`` (slow: every lane of every step as predicted).

I/O moves whole `IO_ALIGN` blocks between aligned host windows and aligned file offsets with ``O_DIRECT`` (the page
cache is never used, so the host footprint is the windows'), or, on filesystems that refuse ``O_DIRECT``, with
``fdatasync`` + ``posix_fadvise(DONTNEED)`` (Note: [Spilled bytes leave RAM] in activations/nvme.py). Every read and
write is recorded in the trace on the lanes ``nvme_read`` / ``nvme_write`` with its logical bytes, the figures
`lazytrain_hf.planner.schedule` predicts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from ..activations import nvme as _io
from ..activations.nvme import IOThreads
from ..activations.tiers import round_up
from ..optim.quant import dynamic_lookup, num_blocks
from ..planner import layouts
from ..planner.layouts import IO_ALIGN, state_file_bytes  # noqa: F401 (re-exported)
from ..streams import SimDelay
from ..threads import background_worker
from ..units import format_bytes

# read_committed and update_bytes are public names of this module too (planner, tests and benchmarks import them here)
from .statefiles import MANIFEST, gather_scales, read_committed, update_bytes  # noqa: F401
from .statelayout import StateNvmeError, StateParam, StateUnit, aligned_empty, poison, poisoned_like, rebind
from .stateupdate import ChunkedUpdate
from .statewindows import FetchWindows, WindowPool

BUILD_WINDOW = 64 << 20  # bytes of the window a unit's state is written through when it is moved to its file
_DIR_PREFIX = "lazytrain-state_"
_DIR_RE = re.compile(r"^lazytrain-state_(?P<host>[0-9a-f]{8})_(?P<pid>\d+)_(?P<start>\d+)_")


class NvmeState(ChunkedUpdate):
    """The training state of the units in ``plan.state_nvme`` on NVMe (see the module docstring).

    Args:
        root: ``state_nvme_dir``; a private directory is made in it (and removed by `close`).
        trace: the executor's `Trace`.
        block_size, min_8bit_size: the optimizer's 8-bit layout (`HybridAdamW8bit`); checked against it in `bind`.
        io_mode: ``"auto"`` (``O_DIRECT`` where the filesystem takes it, else fdatasync + DONTNEED), ``"direct"``,
            ``"fadvise"``.
        pin_memory: the fetch and gradient windows, which lanes copy from and to, are registered
            (`lazytrain_hf.streaming.statewindows`; `streams.pin_host_memory`).
        simulated: the executor runs on the simulated lanes: the reader's fetch jobs are delayed like every simulated
            worker's (Note: [A fetch from NVMe is read off the step's threads]).
    """

    def __init__(
        self, root: str, trace, block_size: int = 256, min_8bit_size: int = 4096, io_mode: str = "auto",
        pin_memory: bool = False, simulated: bool = False,
    ):  # fmt: skip
        root = _io.check_dir(root, "state_nvme_dir")
        if block_size & (block_size - 1) or not 16 <= block_size <= 4096:
            raise ValueError(f"optim_block_size={block_size} must be a power of two in [16, 4096].")
        self.root = root
        self.trace = trace
        self.block_size = int(block_size)
        self.min_8bit_size = int(min_8bit_size)
        self.removed_stale = remove_stale_state_dirs(root)
        prefix = f"{_DIR_PREFIX}{_io._host_id()}_{os.getpid()}_{_io._process_start_ticks(os.getpid())}_"
        self.path = tempfile.mkdtemp(prefix=prefix, dir=root)
        why = _io.probe_direct_io(self.path) if io_mode in ("auto", "direct") else "fadvise requested"
        if why is not None and io_mode == "direct":
            shutil.rmtree(self.path, ignore_errors=True)
            raise ValueError(f"state_nvme_dir={root!r}: {why}; use a filesystem that supports O_DIRECT.")
        self.direct = why is None
        self.io_reason = "O_DIRECT with 4096-byte aligned buffers, offsets and sizes" if self.direct else why
        self.units: dict[int, StateUnit] = {}
        self.step = 0
        # daemon threads started now (Note: [Spill I/O threads never block exit] in activations/nvme.py)
        self._reader = IOThreads(1, "lazytrain-state-r")
        self._writer = IOThreads(1, "lazytrain-state-w")
        self._windows = WindowPool(pin_memory, IO_ALIGN)  # registered gradient windows
        self.fetch_windows = FetchWindows(pin_memory, IO_ALIGN)  # Note: [A fetch from NVMe is read off the ...]
        self._read_delay = SimDelay("state-read") if simulated else None
        self._source = None  # the DiskSource of parameters left on disk by remove() (`leave_on_disk`)
        self._in_pass = False  # an optimizer pass wrote some unit since the last commit (it failed if it stays so)
        self._handed_over = False
        self._entries: dict[str, tuple[int, Any]] = {}  # parameter name -> (unit key, its store entry)
        self._zero_m = dynamic_lookup(True).zero_code
        self._zero_v = dynamic_lookup(False).zero_code
        self._write_manifest()

    def __repr__(self) -> str:
        return f"NvmeState(path={self.path!r}, units={sorted(self.units)}, direct={self.direct}, step={self.step})"

    # ------------------------------------------------------------------ raw I/O
    def _pwrite(self, u: StateUnit, buf: torch.Tensor, nbytes: int, offset: int) -> None:
        """Write ``nbytes`` of the aligned window ``buf`` at ``offset`` (a multiple of `IO_ALIGN`)."""
        try:
            if self.direct:
                _io._pwrite_all(u.fd, _io._bytes_of(buf[: round_up(nbytes, IO_ALIGN)]), offset)
            else:
                _io._pwrite_all(u.fd, _io._bytes_of(buf[:nbytes]), offset)
                os.fdatasync(u.fd)
                _io._drop_cached(u.fd, offset, nbytes)
        except OSError as e:
            raise StateNvmeError(
                e.errno,
                f"writing {format_bytes(nbytes)} of the training state of unit {u.key} to {u.path} failed "
                f"({e.strerror or e}); free space on state_nvme_dir={self.root!r} (the run needs about "
                f"{format_bytes(self.file_bytes())} there) or point state_nvme_dir at a larger disk. The last "
                f"committed step ({self.step}) is intact.",
            ) from e

    def _pread(self, u: StateUnit, out: torch.Tensor, nbytes: int, offset: int) -> None:
        try:
            if self.direct:
                _io._pread_all(u.fd, _io._bytes_of(out[: round_up(nbytes, IO_ALIGN)]), offset)
            else:
                _io._pread_all(u.fd, _io._bytes_of(out[:nbytes]), offset)
                _io._drop_cached(u.fd, offset, nbytes)
        except OSError as e:
            raise StateNvmeError(
                e.errno, f"reading the training state of unit {u.key} from {u.path} failed ({e.strerror or e})."
            ) from e

    def _read_range(self, u: StateUnit, out: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
        """Read ``nbytes`` at any ``offset`` (aligned superset into ``out``); returns the ``nbytes`` view."""
        lo = offset - offset % IO_ALIGN
        hi = round_up(offset + nbytes, IO_ALIGN)
        self._pread(u, out, hi - lo, lo)
        return out.narrow(0, offset - lo, nbytes)

    def file_bytes(self) -> int:
        return sum(os.fstat(u.fd).st_size for u in self.units.values() if u.fd >= 0)

    # ------------------------------------------------------------------ building
    def add_unit(self, key: int, ls) -> None:
        """Move the freshly built `LayerStore` ``ls`` of unit ``key`` to its file (compute copy, masters, zero
        moments as generation 0) and release its RAM: its flat buffers and views then point at poison."""
        lay = ls.layout
        params: list[StateParam] = []
        off = round_up(lay.compute_bytes, IO_ALIGN)
        grad_off = off
        off += round_up(4 * lay.train_elems, IO_ALIGN)
        ents = ls.trainable_entries
        chunk = int(layouts.CHUNK_ELEMS)  # read now: tests set a smaller one
        if chunk % IO_ALIGN or chunk % self.block_size:
            raise ValueError(f"CHUNK_ELEMS={chunk} must be a multiple of {IO_ALIGN} and of the block size.")
        for e in ents:
            q8 = e.numel >= self.min_8bit_size
            nblk = num_blocks(e.numel, self.block_size) if q8 else 0
            slot = round_up(4 * (chunk // self.block_size), IO_ALIGN)
            params.append(StateParam(e.name, e.numel, e.elem_offset, q8, nblk, (0, 0), chunk=chunk, abs_slot=slot))
        for g in (0, 1):
            for p in params:
                a = round_up(4 * p.numel, IO_ALIGN)
                p.master = (off, p.master[1]) if g == 0 else (p.master[0], off)
                off += a
                if p.q8:
                    c = round_up(p.numel, IO_ALIGN)
                    s = len(p.chunks()) * p.abs_slot
                    for attr, size in (("m_codes", c), ("v_codes", c), ("m_abs", s), ("v_abs", s)):
                        cur = getattr(p, attr)
                        setattr(p, attr, (off, cur[1]) if g == 0 else (cur[0], off))
                        off += size
        path = os.path.join(self.path, f"unit{key:+05d}.state")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
        fd = os.open(path, flags, 0o600)
        if not self.direct:
            _io.no_readahead(fd)
        fused = not ls.aliased and bool(ents) and all(e.dtype == torch.bfloat16 for e in ents)
        u = StateUnit(
            key,
            path,
            fd,
            lay.compute_bytes,
            grad_off,
            lay.train_elems,
            params,
            len(ents) < len(ls.entries),
            fused,
            ls.aliased,
            [(e.byte_offset, e.numel, e.dtype) for e in ents],
        )
        self.units[key] = u
        for e in ls.entries:
            self._entries[e.name] = (key, e)
        try:
            os.ftruncate(fd, off)
            # written through one bounded window (`BUILD_WINDOW` bytes), so moving a unit to its file needs no
            # second copy of it in RAM
            need = max([lay.compute_bytes, 1] + [4 * p.numel for p in params])
            win = aligned_empty(min(BUILD_WINDOW, round_up(need, IO_ALIGN)))

            def put(src_u8: torch.Tensor | None, nbytes: int, offset: int, fill: int = 0) -> None:
                for a in range(0, nbytes, win.numel()):
                    n = min(win.numel(), nbytes - a)
                    if src_u8 is None:
                        win[:n].fill_(fill)
                    else:
                        win[:n].copy_(src_u8[a : a + n])
                    self._pwrite(u, win, n, offset + a)

            put(ls.compute_bytes, lay.compute_bytes, 0)
            for p, e in zip(params, ents):
                put(ls.master_views[e.name].reshape(-1).view(torch.uint8), 4 * p.numel, p.master[0])
                if p.q8:
                    s = len(p.chunks()) * p.abs_slot
                    put(None, p.numel, p.m_codes[0], self._zero_m)
                    put(None, p.numel, p.v_codes[0], self._zero_v)
                    put(None, s, p.m_abs[0])
                    put(None, s, p.v_abs[0])
                else:
                    p.small = (torch.zeros(p.numel), torch.zeros(p.numel))
        except BaseException:
            self.close()
            raise
        # the unit's RAM goes: every tensor of the store over its buffers is replaced by poison (new tensors, not
        # views: a view keeps its base alive), and the parameters, which `add_layer` pointed at their compute or
        # master view, at their poisoned compute view, so the buffers go now, not once the whole store is built
        for name in ("compute_bytes", "compute", "master", "grad"):
            if getattr(ls, name) is not None:
                setattr(ls, name, poisoned_like(getattr(ls, name)))
        for views in (ls.compute_views, ls.master_views, ls.grad_views):
            for k in list(views):
                views[k] = poisoned_like(views[k])
        with torch.no_grad():
            for e in ls.entries:
                e.param.data = ls.compute_views[e.name]
        ls.release_pinned()  # unregistered, then freed (Note: [Unregister before free] in lazytrain_hf/pinned.py)
        self._write_manifest()

    # ------------------------------------------------------------------ weight fetches
    def fetch(self, key: int, issue: Callable[[torch.Tensor], Any]) -> Future:
        """Queue the read of unit ``key``'s compute copy on the reader thread and return at once (Note: [A fetch from
        NVMe is read off the step's threads]). Once the read landed in a fetch window, the reader calls
        ``issue(window)`` (uint8, the unit's ``compute_bytes``), which issues the window's copy and returns the copy's
        event; the window is reused only after that event. The Future's result is that event (or the read's error)."""
        u = self.units[key]
        self.trace.transfer("nvme_read", u.compute_bytes, "uint8", key, "fetch")  # issued now, in this stage
        return self._reader.submit(self._fetch_job, u, issue)

    def _fetch_job(self, u: StateUnit, issue: Callable[[torch.Tensor], Any]) -> Any:
        with background_worker():  # its waits (a window's last copy) do not stall the step
            if self._read_delay is not None:
                self._read_delay.sleep()
            block = self.fetch_windows.get(u.compute_bytes)
            ev = None
            try:
                self._pread(u, block.tensor, u.compute_bytes, 0)
                ev = issue(block.tensor[: u.compute_bytes])
            finally:
                self.fetch_windows.put(block, ev)  # reused once the copy read it (or now, when none was issued)
            return ev

    def read_compute(self, key: int, what: str = "fetch") -> torch.Tensor:
        """The unit's compute copy read now, on the calling thread, into a fresh aligned host window (uint8, its
        ``compute_bytes``): the synchronous CPU engine's fetch, whose copy is synchronous too."""
        return self._compute_window(key, what)[: self.units[key].compute_bytes]

    def _compute_window(self, key: int, what: str) -> torch.Tensor:
        u = self.units[key]
        win = aligned_empty(u.compute_bytes)
        self.trace.transfer("nvme_read", u.compute_bytes, "uint8", key, what)
        self._pread(u, win, u.compute_bytes, 0)
        return win

    # ------------------------------------------------------------------ gradients
    def open_grad(self, key: int, ls, accumulate: bool, defer_read: bool = False) -> Any:
        """Point the unit's gradient accumulator (``ls.grad`` and its views) at a zeroed host window; with
        ``accumulate`` the window first reads the gradient accumulated so far: now, or with ``defer_read`` by the
        returned callable (run it before anything reads the window: the executor's host worker, in order before
        the addition; None when there is nothing to read)."""
        u = self.units[key]
        nbytes = 4 * u.train_elems
        # registered when pinned: the D2H copy of a fresh gradient lands in it
        block = self._windows.get(nbytes) if self._windows.pin else None
        win = aligned_empty(nbytes) if block is None else block.tensor
        read = None
        if accumulate:

            def read() -> None:
                self.trace.transfer("nvme_read", nbytes, torch.float32, key, "grad")
                self._pread(u, win, nbytes, u.grad_off)

            if not defer_read:
                read()
                read = None
        else:
            win[:nbytes].zero_()  # alignment padding between parameters is part of the norm: zeros
        rebind(ls.grad, win, 0, torch.Size([u.train_elems]))
        for e in ls.trainable_entries:
            rebind(ls.grad_views[e.name], win, 4 * e.elem_offset, e.shape)
        ls._grad_window, ls._grad_block = win, block
        return read

    def close_grad(self, key: int, ls) -> None:
        """Write the gradient window back to the unit's file and release it."""
        u = self.units[key]
        win = ls.__dict__.pop("_grad_window")
        nbytes = 4 * u.train_elems
        self.trace.transfer("nvme_write", nbytes, torch.float32, key, "grad")
        self._pwrite(u, win, nbytes, u.grad_off)
        poison(ls.grad)
        for t in ls.grad_views.values():
            poison(t)
        block = ls.__dict__.pop("_grad_block", None)
        if block is not None:
            self._windows.put(block)

    def window_bytes(self) -> int:
        """Bytes of the registered windows (`statewindows.WindowPool`, `FetchWindows`), free or in use."""
        return self._windows.allocated_bytes + self.fetch_windows.allocated_bytes

    def read_grads(self, key: int, ls) -> dict[str, torch.Tensor]:
        """Copies of the unit's accumulated gradients read from its file (the public gradient API)."""
        u = self.units[key]
        nbytes = 4 * u.train_elems
        win = aligned_empty(nbytes)
        self.trace.transfer("nvme_read", nbytes, torch.float32, key, "grad")
        self._pread(u, win, nbytes, u.grad_off)
        flat = win[:nbytes].view(torch.float32)
        return {e.name: flat.narrow(0, e.elem_offset, e.numel).view(e.shape) for e in ls.trainable_entries}

    def commit(self, step: int) -> None:
        """Make the generations written since the last commit the committed state of optimizer step ``step``
        (Note: [The state on NVMe commits per optimizer step])."""
        for u in self.units.values():
            if u.pending is not None:
                try:
                    os.fdatasync(u.fd)
                except OSError as e:
                    raise StateNvmeError(e.errno, f"flushing {u.path} failed ({e.strerror or e}).") from e
        for u in self.units.values():
            if u.pending is not None:
                u.gen = 1 - u.gen
                for p in u.params:
                    p.step = u.pending.get(p.name, p.step)
                u.pending = None
        self.step = int(step)
        self._in_pass = False
        self._write_manifest()

    def _manifest(self) -> dict:
        return {
            "format": 1,
            "step": self.step,
            "block_size": self.block_size,
            "min_8bit_size": self.min_8bit_size,
            "units": {
                str(k): {
                    "file": os.path.basename(u.path),
                    "gen": u.gen,
                    "params": [
                        {
                            "name": p.name,
                            "numel": p.numel,
                            "q8": p.q8,
                            "nblk": p.nblk,
                            "step": p.step,
                            "master": list(p.master),
                            "m_codes": list(p.m_codes),
                            "v_codes": list(p.v_codes),
                            "m_abs": list(p.m_abs),
                            "v_abs": list(p.v_abs),
                            "chunk": p.chunk,
                            "abs_slot": p.abs_slot,
                        }
                        for p in u.params
                    ],
                }
                for k, u in self.units.items()
            },
        }

    def _write_manifest(self) -> None:
        tmp = os.path.join(self.path, f".{MANIFEST}.tmp")
        with open(tmp, "w") as f:
            json.dump(self._manifest(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.path, MANIFEST))
        dfd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    # ------------------------------------------------------------------ reading the committed state
    def read_param(self, key: int, name: str, what: str) -> torch.Tensor:
        """A fresh RAM copy of one committed array of parameter ``name`` of unit ``key``: ``what`` is ``master``
        (fp32, flat), ``m_codes``, ``v_codes`` (uint8), ``m_abs``, ``v_abs`` (fp32 block scales); for tensors
        under ``min_8bit_size`` ``exp_avg`` / ``exp_avg_sq`` (fp32, from RAM)."""
        u = self.units[key]
        p = next(p for p in u.params if p.name == name)
        if what in ("exp_avg", "exp_avg_sq"):
            return p.small[0 if what == "exp_avg" else 1].clone()
        if what in ("m_abs", "v_abs"):
            s = len(p.chunks()) * p.abs_slot
            w = aligned_empty(s)
            self._pread(u, w, s, getattr(p, what)[u.gen])
            return gather_scales(w[:s], p.chunks(), p.abs_slot, self.block_size)
        n, dt = {"master": (4 * p.numel, torch.float32), "m_codes": (p.numel, torch.uint8)}.get(
            what, (p.numel, torch.uint8)
        )
        w = aligned_empty(n)
        self._pread(u, w, n, getattr(p, what)[u.gen])
        return w[:n].view(dt).clone()

    def write_param(self, key: int, name: str, what: str, value: torch.Tensor) -> None:
        """Overwrite one committed array (as `read_param` names them): resuming from a checkpoint."""
        u = self.units[key]
        p = next(p for p in u.params if p.name == name)
        if what in ("exp_avg", "exp_avg_sq"):
            p.small[0 if what == "exp_avg" else 1].copy_(value.reshape(-1))
            return
        if what in ("m_abs", "v_abs"):
            s = len(p.chunks()) * p.abs_slot
            w = aligned_empty(s)
            w[:s].zero_()
            scales = value.detach().reshape(-1).to(torch.float32)
            for a, b in p.chunks():
                ba, bb = a // self.block_size, num_blocks(b, self.block_size)
                w.narrow(0, p.abs_at(a), 4 * (bb - ba)).view(torch.float32).copy_(scales[ba:bb])
            self._pwrite(u, w, s, getattr(p, what)[u.gen])
            return
        flat = value.detach().reshape(-1).contiguous().view(torch.uint8)
        w = aligned_empty(flat.numel())
        w[: flat.numel()].copy_(flat)
        self._pwrite(u, w, flat.numel(), getattr(p, what)[u.gen])

    def write_compute_param(self, key: int, ls, name: str, value: torch.Tensor) -> None:
        """Overwrite one parameter's compute copy (its bytes in the unit's compute region)."""
        u = self.units[key]
        e = next(e for e in ls.entries if e.name == name)
        win = self._compute_window(key, "restore")
        e.view_bytes(win).copy_(value.to(e.dtype).view(e.shape))
        self._pwrite(u, win, u.compute_bytes, 0)

    def set_steps(self, key: int, steps: dict[str, int]) -> None:
        for p in self.units[key].params:
            if p.name in steps:
                p.step = int(steps[p.name])
        self._write_manifest()

    def param_steps(self, key: int) -> dict[str, int]:
        return {p.name: p.step for p in self.units[key].params}

    # ------------------------------------------------------------------ after training
    def leave_on_disk(self, key: int, ls) -> None:
        """Note: [Units on NVMe after remove()]
        `StreamHandle.remove()` gives every parameter its trained value. A parameter of such a unit that was in RAM
        before `attach` gets it in RAM again, read from the committed state (the fp32 master where the compute copy
        was a bf16 copy of an fp32 parameter, else the compute copy), as without the state on NVMe. One that was
        left on disk before (`lazytrain_hf.from_pretrained`: a model the run was planned not to hold in RAM) stays
        on disk: a meta tensor with a `DiskSource` reading its trained value from the state file. Saving the model
        (`LazyTrainer.save_model`, `checkpoints.save_streamed`), the next `attach` and `LazyTrainer.streaming()`
        read it layer by layer; the state directory goes when the last such parameter does (or at interpreter
        exit). Tests: ``tests/test_state_nvme.py::test_state_on_nvme_bit_exact`` (in RAM again) and
        ``::test_units_from_disk_stay_on_disk``.
        """
        from .store import DISK_ATTR, DiskSource

        # Note: [A frozen parameter keeps its own values] (store.py): a frozen parameter whose state file holds only
        # its rounded compute copy gets its original back, in RAM or on disk where it was (its own DiskSource)
        kept = ls.frozen_originals
        in_ram = [e for e in ls.entries if not e.from_disk]
        if in_ram:
            vals = self.read_values([e.name for e in in_ram if e.name not in kept], restored=True)
            with torch.no_grad():
                for e in in_ram:
                    e.param.data = kept[e.name] if e.name in kept else vals[e.name].to(e.orig_device)
                    e.param.grad = None
        on_disk = [e for e in ls.entries if e.from_disk]
        if any(e.name not in kept for e in on_disk) and self._source is None:
            self._source = DiskSource(self._read_for_disk, f"state_nvme_dir {self.path}")
            weakref.finalize(self._source, _remove_dir, [u.fd for u in self.units.values()], self.path)
            self._handed_over = True
        for e in on_disk:
            p = e.param
            meta = torch.empty(e.shape, dtype=e.orig_dtype or e.dtype, device="meta")
            torch.utils.swap_tensors(p, torch.nn.Parameter(meta, requires_grad=p.requires_grad))
            setattr(p, DISK_ATTR, kept[e.name] if e.name in kept else (self._source, e.name))
            p.grad = None

    def _read_for_disk(self, names: list[str]) -> dict[str, torch.Tensor]:
        return self.read_values(names, restored=True)

    def read_values(self, names: list[str], restored: bool = False) -> dict[str, torch.Tensor]:
        """Fresh RAM copies of the parameters among ``names`` that belong to units on NVMe (the others are left
        out): their compute copy, as the parameters read while the executor is attached; with ``restored`` their
        value after `StreamHandle.remove` (the fp32 master of a bf16 compute copy of an fp32 parameter)."""
        out: dict[str, torch.Tensor] = {}
        windows: dict[int, torch.Tensor] = {}
        for name in names:
            if name not in self._entries:
                continue
            key, e = self._entries[name]
            if restored and e.trainable and e.orig_dtype is not None:
                out[name] = self.read_param(key, name, "master").view(e.shape).to(e.orig_dtype)
                continue
            if e.trainable and self._in_pass:
                # a pass that failed may have rewritten some compute copies: the committed master decides
                out[name] = self.read_param(key, name, "master").view(e.shape).to(e.dtype)
                continue
            if key not in windows:
                windows[key] = self._compute_window(key, "save")
            out[name] = e.view_bytes(windows[key]).to((e.orig_dtype or e.dtype) if restored else e.dtype, copy=True)
        return out

    def release(self) -> None:
        """The executor is removed: close everything unless parameters were left on disk (`leave_on_disk`), whose
        source then owns the files."""
        self._stop_io()
        if not self._handed_over:
            self.close()

    # ------------------------------------------------------------------ lifetime
    def _stop_io(self) -> None:
        """Finish the queued reads and writes, stop the I/O threads (idempotent) and release the fetch windows once
        their copies completed."""
        self._reader.shutdown()
        self._writer.shutdown()
        self.fetch_windows.clear()

    def close(self) -> None:
        """Close the files and remove the private directory."""
        self._stop_io()
        self._windows.clear()
        for u in self.units.values():
            if u.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(u.fd)
                u.fd = -1
        shutil.rmtree(self.path, ignore_errors=True)


def _remove_dir(fds: list[int], path: str) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    shutil.rmtree(path, ignore_errors=True)


def remove_stale_state_dirs(root: str) -> list[str]:
    """Remove the private state directories in ``root`` of processes of this host that are gone."""
    return _io.remove_stale_spill_dirs(root, _DIR_RE)
