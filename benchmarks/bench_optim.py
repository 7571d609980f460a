"""CPU optimizer step time: HybridAdamW8bit (clip folded in) vs torch AdamW (+ clip_grad_norm_) and bitsandbytes.

    python benchmarks/bench_optim.py --sizes 50M,200M --rounds 3 --reps 3 --backends native,numba
    python benchmarks/bench_optim.py --sizes 50M,200M --rounds 3 --reps 3 --backends native,numba --v-rules both

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

``--v-rules both`` also times every HybridAdamW8bit row with the second moment rounded as before issue #14 (to the
nearest code, so a tiny positive v could become 0; Note: [A non-zero second moment keeps a non-zero code] in
lazytrain_hf/optim/quant.py), in the same rounds: the rule is the first midpoint of the unsigned map's lookup
tables, so the two rows run the same kernel code on different tables. Before the tables it prints the in-cache
compute cost per rule and the two rules alternating step by step on one 25M tensor per backend (the comparison
least exposed to a shared machine's drift).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import statistics
import time
from collections.abc import Callable

import torch

from lazytrain_hf.optim import HybridAdamW8bit, Quantized8bit, clip_coefficient, global_norm, partial_sq_norms
from lazytrain_hf.optim.quant import CodeLookup, create_dynamic_map, dynamic_lookup
from lazytrain_hf.units import parse_bytes

MAX_NORM = 1.0
TENSOR_ELEMS = 25_000_000  # parameters are split into "layers" of this size, as a flat per-layer store would
# Lookup of exp_avg_sq per rule: "nonzero" is the optimizer's; "nearest" the rounding before issue #14.
V_RULES = {"nonzero": dynamic_lookup(False), "nearest": CodeLookup.from_map(create_dynamic_map(signed=False))}


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


def native_compute_rates(reps: int, rules: tuple[str, ...], n: int = 1 << 20, inner: int = 20) -> dict[str, float]:
    """ns per element of the native kernel on one thread with every operand in cache (its compute cost alone), per v
    rule; the rules take turns within each repetition, so a drift of a shared machine reaches all alike. Empty when
    the native kernel is unavailable."""
    from lazytrain_hf.optim import native
    from lazytrain_hf.optim.kernels import AdamWScalars

    if not native.available():
        return {}
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen) * 0.02, torch.randn(n, generator=gen) * 1e-3
    scalars = AdamWScalars.make(1e-4, 0.9, 0.999, 1e-8, 0.01, 3, 0.5).as_float32()
    states = {}
    for rule in rules:
        m, v = Quantized8bit.zeros(n, 256, signed=True), Quantized8bit.zeros(n, 256, signed=False)
        v.lookup = V_RULES[rule]
        states[rule] = (m, v)

    def run(rule: str) -> None:
        m, v = states[rule]
        for _ in range(inner):
            native.adamw8bit_step(p, g, m, v, scalars, None, 1, 256)

    best = {rule: math.inf for rule in rules}
    for _ in range(reps + 2):
        for rule in rules:
            best[rule] = min(best[rule], min(_time(lambda r=rule: run(r), 1, warmup=0)))
    return {rule: t / inner / n * 1e9 for rule, t in best.items()}


def native_compute_rate(reps: int, n: int = 1 << 20, inner: int = 20) -> float | None:
    """`native_compute_rates` of the optimizer's own rule (None when the native kernel is unavailable)."""
    return native_compute_rates(reps, ("nonzero",), n, inner).get("nonzero")


def rule_ab(backend: str, n: int = TENSOR_ELEMS, steps: int = 30, skip: int = 4) -> dict[str, list[float]]:
    """Step times of one ``n``-element tensor per v rule, the two rules alternating step by step (the order flips
    every step) so that a drift of a shared machine reaches both alike; the first ``skip`` steps are dropped."""
    from lazytrain_hf.optim.kernels import AdamWScalars, adamw8bit_step

    gen = torch.Generator().manual_seed(0)
    cases = {}
    for rule in ("nonzero", "nearest"):
        p, g = torch.randn(n, generator=gen) * 0.02, torch.randn(n, generator=gen) * 1e-3
        m, v = Quantized8bit.zeros(n, 256, signed=True), Quantized8bit.zeros(n, 256, signed=False)
        v.lookup = V_RULES[rule]
        cases[rule] = (p, g, m, v)
    times: dict[str, list[float]] = {rule: [] for rule in cases}
    for step in range(1, steps + 1):
        scalars = AdamWScalars.make(1e-4, 0.9, 0.999, 1e-8, 0.01, step, 0.5)
        for rule in ("nonzero", "nearest") if step % 2 else ("nearest", "nonzero"):
            p, g, m, v = cases[rule]
            t = time.perf_counter()
            adamw8bit_step(p, g, m, v, scalars, None, backend)
            times[rule].append(time.perf_counter() - t)
    return {rule: ts[skip:] for rule, ts in times.items()}


def _torch_case(n: int, reps: int, **kwargs) -> list[float]:
    params = _params(n)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kwargs)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()

    return _time(step, reps)


def _hybrid_case(
    n: int, reps: int, host_norm: bool, bf16: bool, backend: str | None = None, v_rule: str = "nonzero"
) -> list[float]:
    params = _params(n)
    opt = HybridAdamW8bit([{"params": [p]} for p in params], lr=1e-4, weight_decay=0.01, backend=backend)
    outs = [torch.empty(p.numel(), dtype=torch.bfloat16) for p in params] if bf16 else [None] * len(params)
    device_norm = global_norm(partial_sq_norms(p.grad for p in params))
    for i, p in enumerate(params):  # one step creates the state, whose v lookup then selects the rule
        opt.step_group(i)
        opt.state[p]["exp_avg_sq"].lookup = V_RULES[v_rule]

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


def make_cases(
    reps: int,
    backends: list[str],
    foreach: bool = True,
    bnb_reps: int | None = None,
    v_rules: tuple[str, ...] = ("nonzero",),
) -> list[Case]:
    """(name, bytes per parameter, run(n) -> step times or None when not importable), torch fused first. A rule
    other than the optimizer's own is named in the row (``v nearest``: before issue #14)."""
    cases: list[Case] = [("torch AdamW fused + clip_grad_norm_", 40, lambda n: _torch_case(n, reps, fused=True))]
    if foreach:
        cases.append(("torch AdamW foreach + clip_grad_norm_", 40, lambda n: _torch_case(n, reps, foreach=True)))
    for backend in backends:
        for rule in v_rules:
            tag = backend if rule == "nonzero" else f"{backend}, v {rule}"
            for label, bpp, host_norm, bf16 in (
                ("host norm + fused clip", 20, True, False),
                ("host norm + clip + bf16", 22, True, True),
                ("device norm (step only)", 16, False, False),
            ):
                run = _bound(_hybrid_case, reps, host_norm, bf16, backend, rule)
                cases.append((f"Hybrid8bit[{tag}] {label}", bpp, run))
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
    head = f"{'optimizer step':<58}{'median ms':>10}{'min':>8}{'max':>8}{'x fused':>9}{'(min)':>7}{'B/param':>9}"
    lines = [head + f"{'GB/s':>7}{'% in-place bw':>15}"]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"{r['optimizer']:<58}{'(not importable: skipped)':>40}")
            continue
        lines.append(
            f"{r['optimizer']:<58}{r['median_ms']:>10.1f}{r['min_ms']:>8.1f}{r['max_ms']:>8.1f}"
            f"{r['x_torch_fused']:>9.2f}{r['x_torch_fused_min']:>7.2f}{r['bytes_per_param']:>9}{r['gb_s']:>7.1f}"
            f"{r['pct_in_place_bw']:>14.0f}%"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# --step-bound: the largest step on sparse gradients (issue #14)
# ----------------------------------------------------------------------------------------------------------------

BOUND_LR = 1e-3
BOUND_BLOCK = 256


def _issue_grads() -> list[torch.Tensor]:
    """Issue #14's reproduction: a dense step, then three in which rows 0-31 have a zero gradient."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, 512, generator=gen) * 1e-2]
    for _ in range(3):
        g = torch.randn(64, 512, generator=gen) * 1e-2
        g[:32] = 0
        grads.append(g)
    return grads


def _sparse_case(rng: random.Random) -> list[torch.Tensor]:
    """One draw from the space of tests/test_optim_sparse.py's property test: zero rows (a changing fraction per
    step), tiny rows and tiny elements (1e-6..1e-3 of their row), row scales over 0-3 decades."""
    rows, cols = rng.randint(4, 48), rng.choice([32, 64, 100, 256, 512])
    tiny_frac, tiny, decades = rng.random() * 0.5, rng.choice([1e-4, 1e-3, 1e-6]), rng.random() * 3
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    scale = 10 ** (-decades * torch.rand(rows, 1, generator=gen))
    grads = []
    for _ in range(rng.randint(2, 10)):
        frac = rng.random()
        g = torch.randn(rows, cols, generator=gen) * 1e-2 * scale
        r = torch.rand(rows, generator=gen)
        g[r < frac] = 0
        g[(r >= frac) & (r < frac + tiny_frac)] *= tiny
        g[torch.rand(rows, cols, generator=gen) < tiny_frac] *= tiny
        grads.append(g)
    return grads


def _embedding_grads(seed: int, steps: int = 40, vocab: int = 512, dim: int = 256, used: int = 40) -> list:
    """Rows are tokens: each step 40 of 512 rows (skewed frequencies) get a gradient, with a per-row scale."""
    gen = torch.Generator().manual_seed(seed)
    freq = torch.rand(vocab, generator=gen) ** 3
    grads = []
    for _ in range(steps):
        g = torch.zeros(vocab, dim)
        rows = torch.multinomial(freq, used, generator=gen)
        g[rows] = torch.randn(used, dim, generator=gen) * 1e-2 * torch.exp(torch.randn(used, 1, generator=gen))
        grads.append(g.view(-1))
    return grads


def _growing_grads(seed: int, steps: int = 40, n: int = 256 * 64) -> list[torch.Tensor]:
    """10% of the elements grow x1.11 per step (AdamW's own steps exceed lr there), 30% zero at each step."""
    gen = torch.Generator().manual_seed(seed)
    grow = torch.rand(n, generator=gen) < 0.1
    grads = []
    for t in range(steps):
        g = torch.randn(n, generator=gen) * 1e-2
        g[grow] = 1e-4 * 1.11**t
        g[torch.rand(n, generator=gen) < 0.3] = 0
        grads.append(g)
    return grads


def _heavy_grads(seed: int, sigma: float, steps: int = 40, n: int = 256 * 64) -> list[torch.Tensor]:
    """Element scales log-normal with ``sigma`` (s=4: e**+-8 between elements of one block), 30% zero per step."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(n, generator=gen) * sigma)
    grads = []
    for _ in range(steps):
        g = torch.randn(n, generator=gen) * 1e-2 * scale * torch.exp(torch.randn(n, generator=gen) * 0.5)
        g[torch.rand(n, generator=gen) < 0.3] = 0
        grads.append(g)
    return grads


def _spike_grads(seed: int, steps: int = 60, n: int = 256 * 64) -> list[torch.Tensor]:
    """Adversarial: per block one element spikes (10, 1000x the others' scale) at step 1 then stays silent, so the
    block's absmax of v stays large while the others, spread over 12 decades, are zero half of the steps."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10 ** (-12 * torch.rand(n, generator=gen))
    grads = []
    for t in range(steps):
        g = torch.randn(n, generator=gen) * 1e-2 * scale
        g[torch.rand(n, generator=gen) < 0.5] = 0
        g[::BOUND_BLOCK] = 10.0 if t == 0 else 0.0
        grads.append(g)
    return grads


def step_bound_cases() -> dict[str, list[list[torch.Tensor]]]:
    """name -> gradient sequences (each one run from fresh state)."""
    rng = random.Random(0)
    return {
        "issue #14 reproduction": [_issue_grads()],
        "property-test space (300 draws)": [_sparse_case(rng) for _ in range(300)],
        "embedding rows (40 of 512 per step)": [_embedding_grads(s) for s in range(3)],
        "growing gradients (x1.11 per step)": [_growing_grads(s) for s in range(3)],
        "heavy-tailed elements (log-normal s=2)": [_heavy_grads(s, 2.0) for s in range(3)],
        "heavy-tailed elements (log-normal s=4)": [_heavy_grads(s, 4.0) for s in range(3)],
        "one spike per block, 12 decades": [_spike_grads(s) for s in range(4)],
    }


def _max_step(make_opt: Callable[[list[torch.Tensor]], torch.optim.Optimizer], grads: list[torch.Tensor]) -> float:
    """Largest |p_after - p_before| / lr over the steps of ``grads``, from p = 0 (weight decay off)."""
    p = torch.nn.Parameter(torch.zeros(grads[0].shape))
    opt = make_opt([p])
    worst = 0.0
    for g in grads:
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        worst = max(worst, ((p.detach() - before).abs().max() / BOUND_LR).item())
    return worst


def _hybrid_rule(backend: str, rule: str) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        opt = HybridAdamW8bit(params, lr=BOUND_LR, weight_decay=0.0, backend=backend)
        for p in params:  # one zero step creates the state (the step moves nothing: m = v = 0)
            p.grad = torch.zeros_like(p)
        opt.step()
        for p in params:
            opt.state[p]["step"] = 0
            if isinstance(opt.state[p]["exp_avg_sq"], torch.Tensor):
                continue  # under min_8bit_size: fp32 moments, no rule
            opt.state[p]["exp_avg_sq"].lookup = V_RULES[rule]
        return opt

    return make


class SqrtV8bit(torch.optim.Optimizer):
    """Reference (torch ops) of the representation issue #14 weighed and the optimizer does not use: 8-bit codes of
    ``sqrt(v)`` (unsigned map, blocks of 256) instead of ``v``, with either rounding rule, and the optimizer's 8-bit
    ``m``; fp32 moments under 4096 elements, as the optimizer. Same operations and order as the kernels."""

    def __init__(self, params, lr: float, rule: str, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})
        self.v_lookup = V_RULES[rule]

    @staticmethod
    def _requantize(x: torch.Tensor, signed: bool, lookup: CodeLookup | None = None) -> torch.Tensor:
        if x.numel() < 4096:
            return x.clone()
        q = Quantized8bit.zeros(x.numel(), BOUND_BLOCK, signed)
        q.lookup = lookup or q.lookup
        return q.quantize_(x).dequantize()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st.update(step=0, m=torch.zeros(p.numel()), s=torch.zeros(p.numel()))
                st["step"] += 1
                g = p.grad.reshape(-1)
                m = st["m"] + (1 - beta1) * (g - st["m"])
                v = (st["s"] * st["s"]) * beta2 + ((1 - beta2) * g) * g
                sq = v.sqrt()
                bc1, bc2s = 1 - beta1 ** st["step"], math.sqrt(1 - beta2 ** st["step"])
                p.view(-1).add_((-(group["lr"] / bc1) * m) / (sq / bc2s + group["eps"]))
                st["m"] = self._requantize(m, signed=True)
                st["s"] = self._requantize(sq, signed=False, lookup=self.v_lookup)


def step_bound_table(backends: list[str]) -> str:
    """Largest step / lr per gradient family: torch AdamW, the kernels per v rule and backend, sqrt(v) references."""
    head = ["gradients", "AdamW"]
    head += [f"v {rule} [{b}]" for rule in ("nearest", "nonzero") for b in backends]
    head += ["sqrt(v) nearest", "sqrt(v) nonzero"]
    lines = [" | ".join(head)]
    adamw = lambda params: torch.optim.AdamW(params, lr=BOUND_LR, weight_decay=0.0, foreach=False)  # noqa: E731
    for name, family in step_bound_cases().items():
        row = [name, f"{max(_max_step(adamw, g) for g in family):.3f}"]
        for rule in ("nearest", "nonzero"):
            row += [f"{max(_max_step(_hybrid_rule(b, rule), g) for g in family):.4g}" for b in backends]
        for rule in ("nearest", "nonzero"):
            make = lambda params, r=rule: SqrtV8bit(params, lr=BOUND_LR, rule=r)  # noqa: E731
            row.append(f"{max(_max_step(make, g) for g in family):.4g}")
        lines.append(" | ".join(row))
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
    parser.add_argument(
        "--v-rules",
        default="nonzero",
        choices=["nonzero", "nearest", "both"],
        help="rounding of exp_avg_sq: the optimizer's (nonzero), the one before issue #14 (nearest), or both",
    )
    parser.add_argument(
        "--step-bound",
        action="store_true",
        help="print only the largest step / lr on sparse gradient families (issue #14), per v rule and backend",
    )
    args = parser.parse_args(argv)
    sizes = [parse_count(s) for s in args.sizes.split(",")]
    v_rules = ("nonzero", "nearest") if args.v_rules == "both" else (args.v_rules,)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if args.step_bound:
        print(f"largest |step| / lr, weight decay off, lr {BOUND_LR}; load average {os.getloadavg()}")
        print(step_bound_table(backends))
        return

    bw = stream_bandwidth(args.reps)
    probe = HybridAdamW8bit([torch.nn.Parameter(torch.zeros(1))])
    from lazytrain_hf.optim import native

    rates = native_compute_rates(args.reps, v_rules)
    rate = rates.get(v_rules[0])
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
        if len(v_rules) > 1:
            print("  same, per v rule: " + ", ".join(f"{rule} {r:.2f} ns/param" for rule, r in rates.items()))
    if len(v_rules) > 1:
        for backend in backends:
            ab = rule_ab(backend)
            print(
                f"v rules alternating step by step, {TENSOR_ELEMS / 1e6:.0f}M elements, {backend}: "
                + ", ".join(
                    f"{rule} median {statistics.median(ts) * 1e3:.1f} ms (min {min(ts) * 1e3:.1f}, {len(ts)} steps)"
                    for rule, ts in ab.items()
                )
            )
    print()
    cases = make_cases(
        args.reps,
        backends,
        bnb_reps=None if args.skip_bnb else args.bnb_reps,
        v_rules=v_rules,
    )
    for n in sizes:
        print(f"== {n / 1e6:.0f}M parameters, {args.rounds} rounds x {args.reps} reps (bitsandbytes: {args.bnb_reps})")
        print(format_rows(measure(n, cases, bw["in_place"], args.rounds)))
        print()


if __name__ == "__main__":
    main()
