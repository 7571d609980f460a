"""The MILP against every baseline on the CPU device, under a device budget tight enough that the plans differ.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_cpu_plans.py                          # 40M and 100M qwen3
    PYTHONPATH=. .venv/bin/python benchmarks/bench_cpu_plans.py --sizes 40m --rounds 2 --json /tmp/cpu_plans.json

For each size (qwen3 from a config, random init, fp32, untied; `bench_cpu_predict.SIZES`):

1. ``hardware.measure(device="cpu", config=...)``: this machine's profile at the model's shapes (per-kind layer times
   removed, so predictions come from `CostModel.from_config`'s terms, as in `bench_cpu_predict.py`).
2. The budget: 1.02 x the largest predicted peak of the baselines that stream (every one but keep_all fits, keep_all
   does not), or ``--budget-fraction`` of keep_all's predicted peak; at least 1.05 x the smallest budget any MILP
   plan fits (`milp.min_gpu_budget`). The plans: the MILP's (`milp.solve` at the
   budget) and every baseline of `baselines.BASELINES` whose plan fits it on our executor (the stage model's
   peak); the others are listed as not fitting.
3. Rounds interleaved in one process (``--rounds``, default 3): in each round every plan is attached to the same
   model, trained ``--warmup`` + ``--steps`` steps as `LazyTrainer` puts one together (`bench_cpu_predict.run_plan`:
   streamed forward and chunked loss, backward, global norm, clip, the layer-wise Hybrid 8-bit update,
   ``zero_grad``), and removed; the profile is measured again at the start of each round. Per plan: the median of
   its rounds' median step times, its prediction on each round's profile (median), and the executor's accounted
   device peak (`StreamHandle.memory_stats()["device_peak_bytes"]`, the max over rounds) against the budget.
4. Printed: measured step, ratio to the MILP's (in each round, then the median of those ratios), predicted step and
   predicted / measured, measured peak / budget, predicted peak.

Predictions: `stages.evaluate_plan` for every plan, megatrain's block checkpointing included: what our executor
does with the plan (megatrain's own model, `baselines.evaluate_megatrain`, describes MegaTrain's executor). Timing by this process's CPU time (``--clock process``, default; the wall clock of a shared 2-core
machine swings 2-3x within a minute) or the wall clock (``--clock wall``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_cpu_predict as bcp  # noqa: E402

MIB = 2**20


def profile_now(cfg, B: int, T: int, name: str):
    from lazytrain_hf.planner import hardware
    from lazytrain_hf.planner.costmodel import CostModel

    p = hardware.measure(
        device="cpu", config=cfg, micro_batch_size=B, seq_len=T, use_cache=False, repeats=3, timer=bcp.CLOCK[0]
    )
    p = dataclasses.replace(p, layer_times={}, layer_times_shape=[])
    return CostModel.from_config(cfg, p, T, B, dtype_bytes=4, model_name=f"qwen3-{name}")


def budget_for(cm, fraction: float | None) -> int:
    """The device budget: ``fraction`` of keep_all's predicted peak, or (``None``) 1.02 x the largest peak of the
    baselines that stream (all but keep_all), so that each of them fits and keep_all does not; at least 1.05 x
    the smallest budget a MILP plan fits."""
    from lazytrain_hf.planner import baselines, milp
    from lazytrain_hf.planner.stages import evaluate_plan

    def peak(name: str) -> int:
        return evaluate_plan(baselines.make_baseline(name, cm), cm).peak_gpu_bytes

    keep = peak("keep_all")
    if fraction is None:
        streaming = [peak(n) for n in baselines.BASELINES if n != "keep_all"]
        budget = min(int(1.02 * max(streaming)), keep - 1)
    else:
        budget = int(keep * fraction)
    least = milp.min_gpu_budget(cm, cm.hardware.default_host_budget(), time_limit=20)
    return max(budget, int(1.05 * least)) if least is not None else budget


def make_plans(cm, budget: int) -> tuple[dict[str, Any], list[str]]:
    """The MILP's plan and every baseline that fits ``budget`` (by name), and the baselines that do not fit."""
    from lazytrain_hf.planner import baselines, milp
    from lazytrain_hf.planner.stages import evaluate_plan

    host = cm.hardware.default_host_budget()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = {"milp": milp.solve(cm, gpu_budget=budget, host_budget=host, time_limit=20)}
    left_out = []
    for name in baselines.BASELINES:
        bp = baselines.make_baseline(name, cm)
        # our executor runs the baseline's plan: the stage model's accounting of it decides (megatrain's own model
        # describes MegaTrain's executor; `baselines.fits` uses that one)
        ev = evaluate_plan(bp, cm)
        if ev.peak_gpu_bytes <= budget and ev.pinned_host_bytes <= host:
            plans[name] = bp
        else:
            left_out.append(name)
    return plans, left_out


def predict(plan, cm) -> tuple[float, int]:
    """(step time, device peak) of our executor running ``plan`` on ``cm``: the stage model."""
    from lazytrain_hf.planner.stages import evaluate_plan

    ev = evaluate_plan(plan, cm)
    return ev.step_time_s, ev.peak_gpu_bytes


def run_with_peak(model, plan, batch, warmup: int, steps: int) -> dict[str, Any]:
    """`bench_cpu_predict.run_plan`, and the executor's accounted device peak over the run."""
    from lazytrain_hf import streaming

    peaks: list[int] = []
    real_attach = streaming.attach

    def attach(*args, **kwargs):
        handle = real_attach(*args, **kwargs)
        real_remove = handle.remove

        def remove():
            peaks.append(handle.memory_stats()["device_peak_bytes"])
            return real_remove()

        handle.remove = remove
        return handle

    streaming.attach = attach
    try:
        res = bcp.run_plan(model, plan, batch, warmup, steps)
    finally:
        streaming.attach = real_attach
    res["peak_bytes"] = peaks[-1]
    return res


def bench_size(name: str, rounds: int, warmup: int, steps: int, fraction: float | None) -> dict[str, Any]:
    from gpu_check_common import build_model, count_params, make_batch

    cfg = bcp.qwen3_config(name)
    B, T = bcp.SIZES[name][5], bcp.SIZES[name][6]
    cm = profile_now(cfg, B, T, name)
    budget = budget_for(cm, fraction)
    plans, left_out = make_plans(cm, budget)
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    batch = make_batch(bcp.VOCAB, B, T, torch.device("cpu"))
    print(
        f"[{name}] {count_params(model) / 1e6:.0f}M params, B={B} T={T}, budget {budget / MIB:.1f} MiB; plans "
        f"{', '.join(plans)}; not fitting: {', '.join(left_out) or 'none'}",
        flush=True,
    )
    rows: dict[str, dict[str, list]] = {k: {"meas": [], "pred": [], "peak": [], "pred_peak": []} for k in plans}
    ratios: dict[str, list[float]] = {k: [] for k in plans}
    for r in range(rounds):
        cm_r = cm if r == 0 else profile_now(cfg, B, T, name)
        load = os.getloadavg()[0]
        meas = {}
        for label, plan in plans.items():
            res = run_with_peak(model, plan, batch, warmup, steps)
            t_pred, peak_pred = predict(plan, cm_r)
            meas[label] = res["step_s"]
            rows[label]["meas"].append(res["step_s"])
            rows[label]["pred"].append(t_pred)
            rows[label]["peak"].append(res["peak_bytes"])
            rows[label]["pred_peak"].append(peak_pred)
        for label in plans:
            ratios[label].append(meas[label] / meas["milp"])
        print(
            f"[{name}] round {r + 1}/{rounds} (load {load:.1f}): "
            + ", ".join(f"{k} {v:.3f} s" for k, v in meas.items()),
            flush=True,
        )
    out = {"size": name, "batch": [B, T], "budget_bytes": budget, "not_fitting": left_out, "plans": []}
    for label in plans:
        m = statistics.median(rows[label]["meas"])
        p = statistics.median(rows[label]["pred"])
        out["plans"].append(
            {
                "plan": label,
                "measured_s": m,
                "rounds_s": rows[label]["meas"],
                "vs_milp": statistics.median(ratios[label]),
                "predicted_s": p,
                "pred_over_meas": p / m,
                "peak_bytes": max(rows[label]["peak"]),
                "predicted_peak_bytes": max(rows[label]["pred_peak"]),
                "peak_over_budget": max(rows[label]["peak"]) / budget,
            }
        )
    del model
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="40m,100m", help=f"comma-separated, of {', '.join(bcp.SIZES)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--budget-fraction",
        type=float,
        default=None,
        help="of keep_all's predicted device peak (default: 1.02 x the largest peak of the streaming baselines)",
    )
    ap.add_argument("--clock", choices=("process", "wall"), default="process")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    bad = [s for s in sizes if s not in bcp.SIZES]
    if bad:
        raise SystemExit(f"--sizes: unknown size {bad[0]!r}; use {', '.join(bcp.SIZES)}.")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0 or args.threads < 1:
        raise SystemExit("--rounds and --steps must be >= 1, --warmup >= 0, --threads >= 1.")
    if args.budget_fraction is not None and not 0 < args.budget_fraction <= 1:
        raise SystemExit(f"--budget-fraction={args.budget_fraction} must be in (0, 1].")
    torch.set_num_threads(args.threads)
    bcp.CLOCK[0] = time.process_time if args.clock == "process" else time.perf_counter
    torch.manual_seed(0)
    t0 = time.perf_counter()
    results = [bench_size(s, args.rounds, args.warmup, args.steps, args.budget_fraction) for s in sizes]
    print()
    head = f"{'size':5s} {'plan':20s} {'meas s':>7s} {'vs milp':>7s} {'pred s':>7s} {'p/m':>5s} "
    print(head + f"{'peak MiB':>8s} {'/budget':>7s} {'pred peak':>9s}")
    for r in results:
        for p in r["plans"]:
            print(
                f"{r['size']:5s} {p['plan']:20s} {p['measured_s']:7.3f} {p['vs_milp']:6.2f}x {p['predicted_s']:7.3f} "
                f"{p['pred_over_meas']:5.2f} {p['peak_bytes'] / MIB:8.1f} {p['peak_over_budget']:7.3f} "
                f"{p['predicted_peak_bytes'] / MIB:9.1f}"
            )
        print(f"{r['size']:5s} budget {r['budget_bytes'] / MIB:.1f} MiB; not fitting: {', '.join(r['not_fitting'])}")
    print(f"total {time.perf_counter() - t0:.0f} s wall, threads {args.threads}, clock {args.clock}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
