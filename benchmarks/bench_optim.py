"""CPU optimizer step time: HybridAdamW8bit (clip folded in) vs torch AdamW (+ clip_grad_norm_) and bitsandbytes.

    python benchmarks/bench_optim.py --sizes 50M,200M --rounds 3 --reps 3 --backends native,numba

Prints one table per size: median / min / max step time over ``--rounds`` round-robin rounds of ``--reps`` timed
repetitions (each round rebuilds every case's state and warms it up, so numba compilation and first-touch page faults
are excluded, and a drift of a shared machine reaches every case alike), the speed ratio to torch fused AdamW +
clip_grad_norm_ of the medians and of the minimums, the bytes each step must move per parameter, the resulting GB/s
and its fraction of the measured in-place bandwidth (``a.add_(b)``: the access pattern of an optimizer, whose state
is updated in place). Before the tables: that bandwidth, and the native kernel's compute cost with its operands in
cache, on one thread: when the kernel is compute-bound (few cores per memory channel) its step time is that cost
divided by the threads, not its bytes over the bandwidth.

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


def stream_bandwidth(reps: int, elems: int = 1 << 28) -> dict[str, float]:
    """GB/s of two streaming operations on ``elems`` floats (default 1 GiB), counting the bytes a program asks for
    (as the B/param column does).

    ``copy``: ``dst.copy_(src)`` (read + write of another buffer: the hardware also reads ``dst`` before writing it,
    which the count leaves out, so it understates the memory system). ``in_place``: ``a.add_(b)`` (reads a and b,
    writes a in place: 12 B/element), the access pattern of an optimizer step, whose state is updated in place.
    """
    a = torch.ones(elems)
    b = torch.ones_like(a)
    copy = 2 * a.numel() * 4 / statistics.median(_time(lambda: b.copy_(a), reps))
    in_place = 3 * a.numel() * 4 / statistics.median(_time(lambda: a.add_(b), reps))
    return {"copy": copy / 1e9, "in_place": in_place / 1e9}


def native_compute_rate(reps: int, n: int = 1 << 20, inner: int = 20) -> float | None:
    """ns per element of the native kernel on one thread with every operand in cache (its compute cost alone)."""
    from lazytrain_hf.optim import Quantized8bit, native
    from lazytrain_hf.optim.kernels import AdamWScalars

    if not native.available():
        return None
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen) * 0.02, torch.randn(n, generator=gen) * 1e-3
    m, v = Quantized8bit.zeros(n, 256, signed=True), Quantized8bit.zeros(n, 256, signed=False)
    scalars = AdamWScalars.make(1e-4, 0.9, 0.999, 1e-8, 0.01, 3, 0.5).as_float32()

    def run() -> None:
        for _ in range(inner):
            native.adamw8bit_step(p, g, m, v, scalars, None, 1, 256)

    return min(_time(run, reps)) / inner / n * 1e9


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


Case = tuple[str, float, Callable[[int], "list[float] | None"]]


def make_cases(reps: int, backends: list[str], foreach: bool = True, bnb_reps: int | None = None) -> list[Case]:
    """(name, bytes per parameter, run(n) -> step times or None when not importable), torch fused first."""
    cases: list[Case] = [("torch AdamW fused + clip_grad_norm_", 40, lambda n: _torch_case(n, reps, fused=True))]
    if foreach:
        cases.append(("torch AdamW foreach + clip_grad_norm_", 40, lambda n: _torch_case(n, reps, foreach=True)))
    for backend in backends:
        cases += [
            (f"Hybrid8bit[{backend}] host norm + fused clip", 20, _bound(_hybrid_case, reps, True, False, backend)),
            (f"Hybrid8bit[{backend}] host norm + clip + bf16", 22, _bound(_hybrid_case, reps, True, True, backend)),
            (f"Hybrid8bit[{backend}] device norm (step only)", 16, _bound(_hybrid_case, reps, False, False, backend)),
        ]
    cases.append(("DeepSpeedCPUAdam + clip_grad_norm_", 40, lambda n: _deepspeed_case(n, reps)))
    if bnb_reps:
        cases.append(("bitsandbytes AdamW8bit (CPU) + clip", 24, lambda n: _bnb_case(n, bnb_reps)))
    return cases


def measure(n: int, cases: list[Case], in_place_gbs: float, rounds: int = 1) -> list[dict]:
    """Run every case on ``n`` parameters, ``rounds`` times round-robin (each round builds the case's state anew and
    times its repetitions), so drifts of a shared machine reach every case alike; one row per case with the median
    and the minimum over all rounds (``skipped`` when the optimizer is not importable)."""
    times: dict[str, list[float] | None] = {name: [] for name, _, _ in cases}
    for _ in range(rounds):
        for name, _, run in cases:
            if times[name] is None:
                continue
            got = run(n)
            gc.collect()
            times[name] = None if got is None else times[name] + got
    rows, base = [], None
    for name, bpp, _ in cases:
        ts = times[name]
        if ts is None:
            rows.append({"optimizer": name, "skipped": True})
            continue
        med, low = statistics.median(ts), min(ts)
        base = base or (med, low)
        gbs = n * bpp / med / 1e9
        rows.append(
            {
                "optimizer": name,
                "samples": len(ts),
                "median_ms": med * 1e3,
                "min_ms": low * 1e3,
                "max_ms": max(ts) * 1e3,
                "x_torch_fused": base[0] / med,
                "x_torch_fused_min": base[1] / low,
                "bytes_per_param": bpp,
                "gb_s": gbs,
                "pct_in_place_bw": 100 * gbs / in_place_gbs,
            }
        )
    return rows


def format_rows(rows: list[dict]) -> str:
    head = f"{'optimizer step':<48}{'median ms':>10}{'min':>8}{'max':>8}{'x fused':>9}{'(min)':>7}{'B/param':>9}"
    lines = [head + f"{'GB/s':>7}{'% in-place bw':>15}"]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"{r['optimizer']:<48}{'(not importable: skipped)':>40}")
            continue
        lines.append(
            f"{r['optimizer']:<48}{r['median_ms']:>10.1f}{r['min_ms']:>8.1f}{r['max_ms']:>8.1f}"
            f"{r['x_torch_fused']:>9.2f}{r['x_torch_fused_min']:>7.2f}{r['bytes_per_param']:>9}{r['gb_s']:>7.1f}"
            f"{r['pct_in_place_bw']:>14.0f}%"
        )
    return "\n".join(lines)


def parse_count(s: str) -> int:
    """Parameter counts, not bytes: "50M" is 50 * 10**6 parameters."""
    s = s.strip().upper()
    return int(float(s[:-1]) * {"K": 1e3, "M": 1e6, "G": 1e9}[s[-1]]) if s[-1] in "KMG" else parse_bytes(s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="50M,200M", help="comma-separated parameter counts, e.g. 50M,200M")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per case and round")
    parser.add_argument("--rounds", type=int, default=3, help="round-robin rounds over the cases (state rebuilt)")
    parser.add_argument("--bnb-reps", type=int, default=1, help="repetitions per round for bitsandbytes (slow)")
    parser.add_argument("--skip-bnb", action="store_true", help="leave out bitsandbytes AdamW8bit")
    parser.add_argument(
        "--backends", default="native,numba", help="HybridAdamW8bit kernel backends to time (native, numba, torch)"
    )
    args = parser.parse_args(argv)
    sizes = [parse_count(s) for s in args.sizes.split(",")]

    bw = stream_bandwidth(args.reps)
    probe = HybridAdamW8bit([torch.nn.Parameter(torch.zeros(1))])
    from lazytrain_hf.optim import native

    rate = native_compute_rate(args.reps)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, HybridAdamW8bit default={probe.backend}")
    print(f"native kernel: {native.isa() if native.available() else native.error()}; load average: {os.getloadavg()}")
    print(
        f"bandwidth (1 GiB): copy_ {bw['copy']:.1f} GB/s, in-place a.add_(b) {bw['in_place']:.1f} GB/s "
        "(bytes asked for: read + write)"
    )
    if rate is not None:
        print(
            f"native kernel compute, operands in cache, 1 thread: {rate:.2f} ns/param; "
            f"{torch.get_num_threads()} threads can do at best {rate / torch.get_num_threads():.2f} ns/param, the "
            f"in-place bandwidth allows {16 / bw['in_place']:.2f} ns/param at 16 B/param"
        )
    print()
    cases = make_cases(
        args.reps,
        [b.strip() for b in args.backends.split(",") if b.strip()],
        bnb_reps=None if args.skip_bnb else args.bnb_reps,
    )
    for n in sizes:
        print(f"== {n / 1e6:.0f}M parameters, {args.rounds} rounds x {args.reps} reps (bitsandbytes: {args.bnb_reps})")
        print(format_rows(measure(n, cases, bw["in_place"], args.rounds)))
        print()


if __name__ == "__main__":
    main()
