"""Activation engine tier bandwidth vs the raw operation it wraps (medians of several repetitions, one run).

NVMe tier: saved tensors of one "layer" go through the engine's saved-tensor hooks (copy into a staging buffer,
background write to the spill file; reload by a background read into a fresh tensor) vs a raw sequential
``write``/``readinto`` of the same bytes into a file in the same directory. CPU tier: the engine's copy into its host
buffer pool (and back) vs a plain ``copy_`` into preallocated buffers; on CUDA vs a plain pinned
``copy_(non_blocking=True)`` + synchronize.

Both sides of each row move the same tensors; the ratio is engine MB/s / raw MB/s (1.0 = no overhead). Files are
written through the page cache on both sides (no fsync), so on a machine with free RAM the NVMe rows measure the
file-system path, not the disk.

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

from lazytrain_hf.activations import ActivationEngine  # noqa: E402
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
) -> tuple[float, float]:
    """Seconds for (offload: pack + all copies/writes complete, reload: prefetch + unpack of every tensor)."""
    dummy = torch.zeros(1, device=device, requires_grad=True)
    module = nn.Identity()
    _sync(device)
    t0 = time.perf_counter()
    engine.begin_layer(0, module, (dummy,), {})
    out = _Save.apply(dummy, *tensors)
    engine.end_layer(0)
    engine.synchronize()
    t1 = time.perf_counter()
    engine.prefetch(0)
    out.sum().backward()
    _sync(device)
    t2 = time.perf_counter()
    engine.end_step()
    return t1 - t0, t2 - t1


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

    rows = []
    for tier, policy in (("nvme", "offload_nvme"), ("cpu", "offload_cpu")):
        plan = Plan.default(1)
        plan.layers[0].policy = policy
        engine = ActivationEngine(plan, device, nvme_dir=root)
        engine_round_trip(engine, tensors, device)  # warm-up: fills the pool, starts the I/O threads
        eng = [engine_round_trip(engine, tensors, device) for _ in range(args.reps)]
        engine.close()
        if tier == "nvme":
            raw_file_round_trip(root, cpu_tensors)
            raw = [raw_file_round_trip(root, cpu_tensors) for _ in range(args.reps)]
            base = "raw file write/readinto"
        else:
            pin = device.type == "cuda"
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]
            raw_copy_round_trip(tensors, host, device)
            raw = [raw_copy_round_trip(tensors, host, device) for _ in range(args.reps)]
            base = "pinned copy_ (non_blocking)" if device.type == "cuda" else "plain copy_"
        for k, direction in ((0, "offload (write)"), (1, "reload (read)")):
            e = total / statistics.median(x[k] for x in eng) / 1e6
            r = total / statistics.median(x[k] for x in raw) / 1e6
            rows.append((f"{tier} {direction}", e, base, r, e / r))
    os.rmdir(root)

    print(
        f"device={device} tensors={args.tensors} x {args.mib} MiB ({total / 2**20:.0f} MiB per layer), "
        f"reps={args.reps} (median), torch threads={torch.get_num_threads()}"
    )
    print(f"{'path':<22} {'engine MB/s':>12}  {'baseline':<28} {'baseline MB/s':>13} {'ratio':>6}")
    for name, e, base, r, ratio in rows:
        print(f"{name:<22} {e:>12.0f}  {base:<28} {r:>13.0f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
