"""Activation engine tier bandwidth vs the raw operation it wraps (medians of several repetitions, one run).

NVMe tier: saved tensors of one "layer" go through the engine's saved-tensor hooks (copy into a staging buffer,
background write to the spill file; reload by a background read into a fresh tensor), once per spill I/O mode
(``direct``: O_DIRECT, ``fadvise``: fdatasync + DONTNEED, ``buffered``: the page cache; See Note: [Spilled bytes
leave RAM] in lazytrain_hf/activations/nvme.py), next to the planner's NVMe probe (`hardware.measure_nvme`: write +
fsync, DONTNEED, sequential read) on the same directory and bytes, and a raw buffered ``write``/``readinto``. The
``resident`` column is the share of the spill files' bytes in the page cache once the writes completed (mincore).
CPU tier: the engine's copy into its host buffer pool (and back) vs a plain ``copy_`` into preallocated buffers; on
CUDA vs a plain pinned ``copy_(non_blocking=True)`` + synchronize.

Both sides of each row move the same tensors; the ratio is engine GB/s / baseline GB/s (1.0 = no overhead); the
NVMe modes are compared with the probe, which is what the planner plans with.

    python benchmarks/bench_offload.py                       # temp dir under /tmp, 8 x 32 MiB, 5 reps
    python benchmarks/bench_offload.py --dir /scratch --mib 64 --tensors 16 --reps 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lazytrain_hf.activations import (
    ActivationEngine,  # noqa: E402
    nvme,  # noqa: E402
)
from lazytrain_hf.activations.nvme import page_cache_bytes  # noqa: E402
from lazytrain_hf.planner import hardware  # noqa: E402
from lazytrain_hf.planner.plan import Plan  # noqa: E402


class _Save(torch.autograd.Function):
    """Saves its tensors for backward and nothing else: isolates the engine's tier path from compute."""

    @staticmethod
    def forward(ctx, dummy, *tensors):
        ctx.save_for_backward(*tensors)
        return dummy.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.got = ctx.saved_tensors  # unpack = reload
        return (grad,) + (None,) * len(ctx.got)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_round_trip(
    engine: ActivationEngine, tensors: list[torch.Tensor], device: torch.device
) -> tuple[float, float, float | None]:
    """Seconds for (offload: pack + all copies/writes complete, reload: prefetch + unpack of every tensor), and the
    share of the spill files' bytes in the page cache after the writes (None without spill files)."""
    dummy = torch.zeros(1, device=device, requires_grad=True)
    module = nn.Identity()
    _sync(device)
    t0 = time.perf_counter()
    engine.begin_layer(0, module, (dummy,), {})
    out = _Save.apply(dummy, *tensors)
    engine.end_layer(0)
    engine.synchronize()
    t1 = time.perf_counter()
    resident = None
    if engine.spill_dir is not None and engine.spill_files():
        paths = [os.path.join(engine.spill_dir, n) for n in engine.spill_files()]
        cached = [page_cache_bytes(p) for p in paths]
        if None not in cached:
            resident = sum(cached) / max(1, sum(os.path.getsize(p) for p in paths))
    t1b = time.perf_counter()
    engine.prefetch(0)
    out.sum().backward()
    _sync(device)
    t2 = time.perf_counter()
    engine.end_step()
    return t1 - t0, t2 - t1b, resident


def raw_file_round_trip(directory: str, tensors: list[torch.Tensor]) -> tuple[float, float]:
    path = os.path.join(directory, "raw.bin")
    views = [memoryview(t.view(torch.uint8).numpy()).cast("B") for t in tensors]
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for v in views:
            f.write(v)
    t1 = time.perf_counter()
    outs = [torch.empty_like(t) for t in tensors]  # a reload hands out fresh tensors: allocate them here too
    with open(path, "rb", buffering=0) as f:
        for o in outs:
            f.readinto(memoryview(o.view(torch.uint8).numpy()).cast("B"))
    t2 = time.perf_counter()
    os.unlink(path)
    assert all(torch.equal(a, b) for a, b in zip(outs, tensors))
    return t1 - t0, t2 - t1


def raw_direct_round_trip(directory: str, tensors: list[torch.Tensor]) -> tuple[float, float] | None:
    """O_DIRECT ``pwrite`` / ``preadv`` of each tensor's bytes from / into one page-aligned buffer (the disk without
    the engine: no staging copy, no fresh tensors); None where O_DIRECT is refused."""
    import mmap

    if nvme.probe_direct_io(directory) is not None:
        return None
    size = max(t.numel() * t.element_size() for t in tensors)
    size = -(-size // nvme.IO_ALIGN) * nvme.IO_ALIGN
    buf = mmap.mmap(-1, size)  # page-aligned
    buf.write(tensors[0].view(torch.uint8).numpy().tobytes()[:size].ljust(size, b"\0"))
    path = os.path.join(directory, "raw-direct.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        t0 = time.perf_counter()
        for i in range(len(tensors)):
            os.pwrite(fd, buf, i * size)
        t1 = time.perf_counter()
        for i in range(len(tensors)):
            os.preadv(fd, [buf], i * size)
        t2 = time.perf_counter()
    finally:
        os.close(fd)
        os.unlink(path)
    return t1 - t0, t2 - t1


def raw_copy_round_trip(
    tensors: list[torch.Tensor], host: list[torch.Tensor], device: torch.device
) -> tuple[float, float]:
    """``host``: preallocated (and already touched) buffers, as the engine's pool has after the first step."""
    pin = device.type == "cuda"
    _sync(device)
    t0 = time.perf_counter()
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=pin)
    _sync(device)
    t1 = time.perf_counter()
    back = [torch.empty_like(t) for t in tensors]  # a reload hands out fresh tensors: allocate them here too
    for b, h in zip(back, host):
        b.copy_(h, non_blocking=pin)
    _sync(device)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="directory for spill / raw files (default: a temp dir under /tmp)")
    ap.add_argument("--mib", type=int, default=32, help="MiB per tensor")
    ap.add_argument("--tensors", type=int, default=8, help="tensors per layer")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    root = tempfile.mkdtemp(prefix="bench-offload-", dir=args.dir or "/tmp")
    n = args.mib * 2**20 // 4
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g).to(device) for _ in range(args.tensors)]
    total = sum(t.numel() * t.element_size() for t in tensors)
    cpu_tensors = [t.cpu() for t in tensors]
    GB = 1e9

    # the planner's probe on the same directory and bytes: (read GB/s, write GB/s) per repetition
    hardware.measure_nvme(root, total)
    probe = [hardware.measure_nvme(root, total)[:2] for _ in range(args.reps)]
    probe_r = statistics.median(p[0] for p in probe)
    probe_w = statistics.median(p[1] for p in probe)

    rows = []  # (path, engine GB/s, baseline name, baseline GB/s, resident share or None)
    modes = []
    for io in ("auto", "fadvise", "buffered"):
        plan = Plan.default(1)
        plan.layers[0].policy = "offload_nvme"
        engine = ActivationEngine(plan, device, nvme_dir=root, nvme_io=io)
        mode = engine.spill_io()["mode"]
        if mode in modes:  # "auto" resolved to a mode measured below / above
            engine.close()
            continue
        modes.append(mode)
        engine_round_trip(engine, tensors, device)  # warm-up: fills the pool, starts the I/O threads
        eng = [engine_round_trip(engine, tensors, device) for _ in range(args.reps)]
        reason = engine.spill_io()["reason"]
        engine.close()
        resident = [x[2] for x in eng if x[2] is not None]
        res = statistics.median(resident) if resident else None
        w = total / statistics.median(x[0] for x in eng) / GB
        r = total / statistics.median(x[1] for x in eng) / GB
        rows.append((f"nvme[{mode}] write", w, "probe: write + fsync", probe_w, res))
        rows.append((f"nvme[{mode}] read", r, "probe: DONTNEED + read", probe_r, None))
        print(f"nvme[{mode}]: {reason}")
    raw_file_round_trip(root, cpu_tensors)
    raw = [raw_file_round_trip(root, cpu_tensors) for _ in range(args.reps)]
    rows.append(("raw buffered write", total / statistics.median(x[0] for x in raw) / GB, "-", None, None))
    rows.append(("raw buffered read", total / statistics.median(x[1] for x in raw) / GB, "-", None, None))
    if raw_direct_round_trip(root, cpu_tensors) is not None:
        raw = [raw_direct_round_trip(root, cpu_tensors) for _ in range(args.reps)]
        rows.append(("raw O_DIRECT write", total / statistics.median(x[0] for x in raw) / GB, "-", None, None))
        rows.append(("raw O_DIRECT read", total / statistics.median(x[1] for x in raw) / GB, "-", None, None))

    plan = Plan.default(1)
    plan.layers[0].policy = "offload_cpu"
    engine = ActivationEngine(plan, device)
    engine_round_trip(engine, tensors, device)
    eng = [engine_round_trip(engine, tensors, device) for _ in range(args.reps)]
    engine.close()
    pin = device.type == "cuda"
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]
    raw_copy_round_trip(tensors, host, device)
    raw = [raw_copy_round_trip(tensors, host, device) for _ in range(args.reps)]
    base = "pinned copy_ (non_blocking)" if pin else "plain copy_"
    for k, direction in ((0, "offload (write)"), (1, "reload (read)")):
        e = total / statistics.median(x[k] for x in eng) / GB
        r = total / statistics.median(x[k] for x in raw) / GB
        rows.append((f"cpu {direction}", e, base, r, None))
    os.rmdir(root)

    print(
        f"device={device} dir={os.path.dirname(root)} tensors={args.tensors} x {args.mib} MiB "
        f"({total / 2**20:.0f} MiB per layer), reps={args.reps} (median), torch threads={torch.get_num_threads()}"
    )
    print(f"{'path':<22} {'GB/s':>7}  {'resident':>8}  {'baseline':<28} {'GB/s':>7} {'ratio':>6}")
    for name, e, base, r, res in rows:
        res_s = "-" if res is None else f"{100 * res:.0f}%"
        r_s = "-" if r is None else f"{r:.2f}"
        ratio = "-" if r is None else f"{e / r:.2f}"
        print(f"{name:<22} {e:>7.2f}  {res_s:>8}  {base:<28} {r_s:>7} {ratio:>6}")


if __name__ == "__main__":
    main()
