"""CPU optimizer step time: HybridAdamW8bit (clip folded in) vs torch AdamW (+ clip_grad_norm_) and bitsandbytes.

    python benchmarks/bench_optim.py --sizes 50M,200M --reps 7 --backends native,numba

Prints one table per size: median / min / max step time over ``--reps`` timed repetitions (after warm-up, so numba
compilation and first-touch page faults are excluded), the speed ratio to torch fused AdamW + clip_grad_norm_,
the bytes each step must move per parameter, the resulting GB/s and its fraction of a measured copy bandwidth.

Bytes per parameter (fp32 master, fp32 grad):
- torch AdamW + clip_grad_norm_: norm reads g (4), scaling reads and writes g (8), AdamW reads p, g, m, v and
  writes p, m, v (28): 40.
- HybridAdamW8bit, host norm: norm reads g (4); fused pass reads p, g (8) and two codes (2), writes p (4) and two
  codes (2): 20 (+2 with the bf16 copy). With the norm taken on the device (the streaming runtime), 16.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable

import torch

from lazytrain_hf.optim import HybridAdamW8bit, clip_coefficient, global_norm, partial_sq_norms
from lazytrain_hf.units import parse_bytes

MAX_NORM = 1.0
TENSOR_ELEMS = 25_000_000  # parameters are split into "layers" of this size, as a flat per-layer store would


def _params(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out, left = [], n
    while left > 0:
        k = min(TENSOR_ELEMS, left)
        p = torch.nn.Parameter(torch.randn(k, generator=gen) * 0.02)
        p.grad = torch.randn(k, generator=gen) * 1e-3
        out.append(p)
        left -= k
    return out


def _time(fn: Callable[[], None], reps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def copy_bandwidth(reps: int) -> float:
    """GB/s of ``dst.copy_(src)`` on 1 GiB, counting bytes read plus written."""
    src = torch.ones(1 << 28)
    dst = torch.empty_like(src)
    times = _time(lambda: dst.copy_(src), reps)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def _torch_case(n: int, reps: int, **kwargs) -> list[float]:
    params = _params(n)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kwargs)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()

    return _time(step, reps)


def _hybrid_case(n: int, reps: int, host_norm: bool, bf16: bool, backend: str | None = None) -> list[float]:
    params = _params(n)
    opt = HybridAdamW8bit([{"params": [p]} for p in params], lr=1e-4, weight_decay=0.01, backend=backend)
    outs = [torch.empty(p.numel(), dtype=torch.bfloat16) for p in params] if bf16 else [None] * len(params)
    device_norm = global_norm(partial_sq_norms(p.grad for p in params))

    def step() -> None:
        norm = global_norm(partial_sq_norms(p.grad for p in params)) if host_norm else device_norm
        coef = clip_coefficient(norm, MAX_NORM)
        for i, out in enumerate(outs):
            opt.step_group(i, clip_coef=coef, out_bf16=out)

    return _time(step, reps)


def _bnb_case(n: int, reps: int) -> list[float] | None:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return None
    params = _params(n)
    opt = bnb.optim.AdamW8bit(params, lr=1e-4, weight_decay=0.01)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()

    return _time(step, reps, warmup=1)


def _deepspeed_case(n: int, reps: int) -> list[float] | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # not installed, or its JIT build fails: the row is reported as skipped
        return None
    params = _params(n)
    opt = DeepSpeedCPUAdam(params, lr=1e-4, weight_decay=0.01, adamw_mode=True)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()

    return _time(step, reps)


def _bound(fn: Callable[..., list[float]], *args) -> Callable[[int], list[float]]:
    return lambda n: fn(n, *args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="50M,200M", help="comma-separated parameter counts, e.g. 50M,200M")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per case (median reported)")
    parser.add_argument("--bnb-reps", type=int, default=2, help="repetitions for bitsandbytes (slow on CPU)")
    parser.add_argument("--skip-bnb", action="store_true", help="leave out bitsandbytes AdamW8bit")
    parser.add_argument(
        "--backends", default="native,numba", help="HybridAdamW8bit kernel backends to time (native, numba, torch)"
    )
    args = parser.parse_args(argv)
    sizes = []
    for s in args.sizes.split(","):
        s = s.strip().upper()
        # Parameter counts, not bytes: "50M" is 50 * 10**6 parameters.
        sizes.append(int(float(s[:-1]) * {"K": 1e3, "M": 1e6, "G": 1e9}[s[-1]]) if s[-1] in "KMG" else parse_bytes(s))

    bw = copy_bandwidth(args.reps)
    probe = HybridAdamW8bit([torch.nn.Parameter(torch.zeros(1))])
    from lazytrain_hf.optim import native

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, HybridAdamW8bit default={probe.backend}")
    print(f"native kernel: {native.isa() if native.available() else native.error()}; load average: {os.getloadavg()}")
    print(f"copy bandwidth (1 GiB dst.copy_(src), read+write): {bw:.1f} GB/s\n")

    cases: list[tuple[str, float, Callable[[int], list[float] | None]]] = [
        ("torch AdamW fused + clip_grad_norm_", 40, lambda n: _torch_case(n, args.reps, fused=True)),
        ("torch AdamW foreach + clip_grad_norm_", 40, lambda n: _torch_case(n, args.reps, foreach=True)),
    ]
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        cases += [
            (
                f"Hybrid8bit[{backend}] host norm + fused clip",
                20,
                _bound(_hybrid_case, args.reps, True, False, backend),
            ),
            (
                f"Hybrid8bit[{backend}] host norm + clip + bf16",
                22,
                _bound(_hybrid_case, args.reps, True, True, backend),
            ),
            (
                f"Hybrid8bit[{backend}] device norm (step only)",
                16,
                _bound(_hybrid_case, args.reps, False, False, backend),
            ),
        ]
    cases += [
        ("DeepSpeedCPUAdam + clip_grad_norm_", 40, lambda n: _deepspeed_case(n, args.reps)),
    ]
    if not args.skip_bnb:
        cases.append(("bitsandbytes AdamW8bit (CPU) + clip", 24, lambda n: _bnb_case(n, args.bnb_reps)))

    for n in sizes:
        print(f"== {n / 1e6:.0f}M parameters, {args.reps} reps (bitsandbytes: {args.bnb_reps})")
        header = f"{'optimizer step':<48}{'median ms':>10}{'min':>8}{'max':>8}{'x fused':>9}{'B/param':>9}"
        print(header + f"{'GB/s':>7}{'% copy':>8}")
        base = None
        for name, bpp, run in cases:
            times = run(n)
            gc.collect()
            if times is None:
                print(f"{name:<48}{'(not importable: skipped)':>40}")
                continue
            med = statistics.median(times)
            base = base or med
            gbs = n * bpp / med / 1e9
            print(
                f"{name:<48}{med * 1e3:>10.1f}{min(times) * 1e3:>8.1f}{max(times) * 1e3:>8.1f}{base / med:>9.2f}"
                f"{bpp:>9}{gbs:>7.1f}{100 * gbs / bw:>7.0f}%"
            )
        print()


if __name__ == "__main__":
    main()
