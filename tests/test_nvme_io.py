"""NVMe spill I/O leaves RAM: O_DIRECT (or fdatasync + DONTNEED) spill files round-trip bit-exactly and their bytes
are not left in the page cache (See Note: [Spilled bytes leave RAM] in lazytrain_hf/activations/nvme.py).

The residency check runs in a child process (`_child`, this file run as a script): it spills a forward's saved
tensors, then measures with ``mmap`` + ``mincore`` (`nvme.page_cache_bytes`) how many bytes of the spill files are
in the page cache once the writes completed and again after the reload, and reports /proc/meminfo ``Cached`` and
the process's VmRSS deltas beside them (those are machine-wide or noisy and only reported). The ``buffered`` mode,
plain page-cache I/O, is measured the same way and must show its bytes resident: the check can fail.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from lazytrain_hf.activations import ActivationEngine, nvme
from lazytrain_hf.planner.plan import Plan

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


class _Save(torch.autograd.Function):
    """Saves its tensors for backward and nothing else; backward stores what autograd unpacked."""

    @staticmethod
    def forward(ctx, dummy, *tensors):
        ctx.save_for_backward(*tensors)
        return dummy.clone()

    @staticmethod
    def backward(ctx, grad):
        _Save.got = list(ctx.saved_tensors)  # the reloaded tensors themselves (layout checked by the caller)
        return (grad,) + (None,) * len(_Save.got)


def nvme_engine(directory: str, io: str = "auto") -> ActivationEngine:
    plan = Plan.default(1)
    plan.layers[0].policy = "offload_nvme"
    return ActivationEngine(plan, "cpu", nvme_dir=directory, nvme_io=io)


def spill(engine: ActivationEngine, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Pack ``tensors`` through the engine's saved-tensor hooks as layer 0; returns the output to backward."""
    dummy = torch.zeros(1, requires_grad=True)
    engine.begin_layer(0, nn.Identity(), (dummy,), {})
    out = _Save.apply(dummy, *tensors)
    engine.end_layer(0)
    return out


def odd_tensors() -> list[torch.Tensor]:
    """Sizes that are not multiples of the 4096-byte block, several dtypes, a strided and a broadcast view."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(37, 129, generator=g)
    return [
        torch.randn(1, generator=g),
        torch.randn(1023, generator=g),  # 4092 bytes
        torch.randn(1025, generator=g).to(torch.bfloat16),
        torch.randint(-(2**31), 2**31 - 1, (3, 333), generator=g, dtype=torch.int32),
        torch.randn(300_001, generator=g),  # ~1.2 MB, not block-aligned
        base.t(),  # transposed (non-contiguous, dense)
        base[:, ::2],  # gapped view
        torch.randn(5, 1, generator=g).expand(5, 700),  # broadcast dimension
        (torch.rand(4097, generator=g) * 1e30).to(torch.float16),  # inf and large values
    ]


def round_trip(engine: ActivationEngine) -> None:
    tensors = odd_tensors()
    for _ in range(2):  # the second step reuses pool buffers and a new set of files
        with engine.step():
            out = spill(engine, tensors)
            engine.synchronize()
            assert engine.spill_files()
            engine.prefetch(0)
            out.sum().backward()
        got = _Save.got
        assert len(got) == len(tensors)
        for i, (a, b) in enumerate(zip(got, tensors)):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), i
            assert torch.equal(a, b), i
        assert engine.spill_files() == []


@pytest.mark.parametrize("io", ["auto", "fadvise", "buffered"])
def test_spill_round_trip_bit_exact(tmp_path, io):
    engine = nvme_engine(str(tmp_path), io)
    info = engine.spill_io()
    want = {"auto": "direct" if nvme.probe_direct_io(str(tmp_path)) is None else "fadvise"}.get(io, io)
    assert info["mode"] == want and info["reason"], info
    round_trip(engine)
    engine.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.sync_engine
def test_spill_round_trip_bit_exact_synchronous_engine(tmp_path):
    """The synchronous engine reads in place for dense layouts except under O_DIRECT (aligned staging)."""
    for io in ("auto", "fadvise"):
        engine = nvme_engine(str(tmp_path), io)
        assert engine.spill_io()["mode"] in ("direct", "fadvise"), engine.spill_io()
        round_trip(engine)  # asserts every restored tensor torch.equal to the saved one, and no file left
        engine.close()


def test_direct_spill_files_are_block_aligned(tmp_path):
    if nvme.probe_direct_io(str(tmp_path)) is not None:
        pytest.skip(f"O_DIRECT unavailable here: {nvme.probe_direct_io(str(tmp_path))}")
    engine = nvme_engine(str(tmp_path))
    tensors = odd_tensors()
    with engine.step():
        out = spill(engine, tensors)
        engine.synchronize()
        (name,) = engine.spill_files()
        size = os.path.getsize(os.path.join(engine.spill_dir, name))
        entries = engine._entries[0]
        assert entries and all(e.offset % nvme.IO_ALIGN == 0 for e in entries)
        assert size % nvme.IO_ALIGN == 0
        assert size == sum(-(-e.layout.nbytes // nvme.IO_ALIGN) * nvme.IO_ALIGN for e in entries)
        out.sum().backward()
    engine.close()


def test_o_direct_refused_falls_back_to_fadvise(tmp_path, monkeypatch):
    """A filesystem that refuses O_DIRECT at open (tmpfs before Linux 6.6, some FUSE / network filesystems):
    ``auto`` falls back to fdatasync + DONTNEED and says why; ``direct`` is refused with the fix."""
    real_open = os.open

    def open_without_direct(path, flags, *a, **k):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(nvme.os, "open", open_without_direct)
    engine = nvme_engine(str(tmp_path))
    info = engine.spill_io()
    assert info["mode"] == "fadvise" and "refuses O_DIRECT" in info["reason"] and "DONTNEED" in info["reason"]
    round_trip(engine)
    engine.close()
    engine = nvme_engine(str(tmp_path), "direct")
    with pytest.raises(ValueError, match="nvme_io='direct'.*nvme_io='auto'"):
        engine.spill_io()
    engine.close()


def test_bad_io_mode_names_the_option(tmp_path):
    with pytest.raises(ValueError, match="nvme_io='fast'.*'auto'"):
        nvme_engine(str(tmp_path), "fast")


# ---------------------------------------------------------------------------------------------------------- residency
def _meminfo_cached() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def _vm_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(directory: str, io: str, mib: int) -> None:
    """Spill ``mib`` MiB in 8 tensors, report page-cache residency of the spill files after writing and reading."""
    torch.set_num_threads(1)
    engine = nvme_engine(directory, io)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(mib * 2**20 // 32, generator=g) for _ in range(8)]
    total = sum(t.numel() * 4 for t in tensors)
    report: dict = {"io": engine.spill_io(), "spilled_bytes": total}
    cached0, rss0 = _meminfo_cached(), _vm_rss()
    with engine.step():
        out = spill(engine, tensors)
        engine.synchronize()  # every write completed
        paths = [os.path.join(engine.spill_dir, n) for n in engine.spill_files()]
        report["file_bytes"] = sum(os.path.getsize(p) for p in paths)
        report["resident_after_write"] = sum(nvme.page_cache_bytes(p) for p in paths)
        report["meminfo_cached_delta_after_write"] = _meminfo_cached() - cached0
        engine.prefetch(0)
        engine._nvme.wait_io()  # every reload read (the files go once backward consumed their entries)
        report["resident_after_read"] = sum(nvme.page_cache_bytes(p) for p in paths)
        report["meminfo_cached_delta_after_read"] = _meminfo_cached() - cached0
        report["vm_rss_delta_after_read"] = _vm_rss() - rss0
        out.sum().backward()
    report["bit_exact"] = all(torch.equal(a, b) for a, b in zip(_Save.got, tensors))
    engine.close()
    print("REPORT " + json.dumps(report), flush=True)


def residency(directory: str, io: str, mib: int = 64) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, LAZYTRAIN_SIMULATE_ASYNC="0")
    proc = subprocess.run(
        [sys.executable, HERE, directory, io, str(mib)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")][-1]
    return json.loads(line[len("REPORT ") :])


@pytest.mark.parametrize("io", ["auto", "fadvise"])
def test_spilled_bytes_do_not_stay_resident(tmp_path, io):
    """After the writes complete (and again after the reads) under 2% of the spill files' bytes are in the page
    cache; the buffered mode, measured the same way, keeps over half of them."""
    if os.path.realpath(str(tmp_path)).startswith("/dev/shm"):
        pytest.skip("tmpfs files are RAM")
    got = residency(str(tmp_path), io)
    buffered = residency(str(tmp_path), "buffered")
    assert got["bit_exact"] and buffered["bit_exact"]
    size = got["file_bytes"]
    assert size >= got["spilled_bytes"]
    for key in ("resident_after_write", "resident_after_read"):
        assert got[key] <= 0.02 * size, (key, got, buffered)
    assert buffered["resident_after_write"] >= 0.5 * buffered["file_bytes"], buffered


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
