"""Planner benchmark: MILP plan vs baselines per zoo model x hardware, all replayed by the simulator.

    python benchmarks/bench_planner.py                       # all zoo models on h800, h200, rtx3090
    python benchmarks/bench_planner.py --models qwen3-8b --hardware h800 --batch h800=8

Prints, per model x hardware at seq 1024 and a fixed micro-batch per hardware: simulated TFLOPS of the MILP plan and
of every baseline with the ratio to ``megatrain`` ("-" when the baseline does not fit the budget), the MILP's
predicted-vs-simulated error, the solver status and seconds; then the largest feasible micro-batch of the MILP and
of ``megatrain`` on rtx3090 and h800.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lazytrain_hf.planner import baselines, milp  # noqa: E402
from lazytrain_hf.planner.costmodel import CostModel  # noqa: E402
from lazytrain_hf.planner.simulate import simulate  # noqa: E402
from lazytrain_hf.planner.zoo import ZOO_MODELS, get_config  # noqa: E402

DEFAULT_BATCH = {"h800": 8, "h200": 8, "a100-80g": 4, "rtx3090": 2, "rtx4090": 2, "cpu": 1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=list(ZOO_MODELS))
    ap.add_argument("--hardware", nargs="*", default=["h800", "h200", "rtx3090"])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", nargs="*", default=[], help="per-hardware micro-batch, e.g. h800=8")
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--solver", default="auto")
    ap.add_argument("--max-batch-hardware", nargs="*", default=["rtx3090", "h800"])
    ap.add_argument("--max-batch-size", type=int, default=256)
    args = ap.parse_args()
    batch = dict(DEFAULT_BATCH)
    for item in args.batch:
        k, v = item.split("=")
        batch[k] = int(v)
    warnings.simplefilter("ignore")

    names = ["milp", *baselines.BASELINES]
    head = f"{'model':<14} {'hw':<8} {'B':>3} " + " ".join(f"{n[:14]:>14}" for n in names)
    head += f" {'milp/megatrain':>14} {'pred err':>8} {'solver':>18} {'solve s':>7}"
    print(f"Simulated TFLOPS at seq {args.seq_len} (ratio to megatrain in brackets; '-' = does not fit)")
    print(head)
    print("-" * len(head))
    ratios: dict[str, list[float]] = {}
    for hw in args.hardware:
        for model in args.models:
            cm = CostModel.from_config(get_config(model), hw, args.seq_len, batch[hw], model_name=model)
            gpu, host = cm.hardware.default_gpu_budget(), cm.hardware.default_host_budget()
            t0 = time.perf_counter()
            try:
                plan = milp.solve(cm, gpu_budget=gpu, host_budget=host, time_limit=args.time_limit, solver=args.solver)
            except milp.PlanInfeasibleError as e:
                print(f"{model:<14} {hw:<8} {batch[hw]:>3} infeasible: needs {e.min_gpu_budget / 2**30:.1f} GiB")
                continue
            solve_s = time.perf_counter() - t0
            sims = {"milp": simulate(plan, cm)}
            for b in baselines.BASELINES:
                bp = baselines.make_baseline(b, cm)
                sims[b] = simulate(bp, cm) if baselines.fits(bp, cm, gpu, host) else None
            mt = sims["megatrain"]
            cells = []
            for n in names:
                s = sims[n]
                if s is None:
                    cells.append(f"{'-':>14}")
                else:
                    r = f"({s.tflops / mt.tflops:.2f}x)" if mt else ""
                    cells.append(f"{s.tflops:>7.1f}{r:>7}")
            ratio = sims["milp"].tflops / mt.tflops if mt else float("nan")
            ratios.setdefault(hw, []).append(ratio)
            err = (plan.predicted["step_time_s"] - sims["milp"].step_time_s) / sims["milp"].step_time_s
            status = f"{plan.solver['name']} {plan.solver['status']}"
            print(
                f"{model:<14} {hw:<8} {batch[hw]:>3} " + " ".join(cells) + f" {ratio:>13.2f}x {100 * err:>+7.2f}%"
                f" {status:>18} {solve_s:>7.1f}",
                flush=True,
            )
    for hw, rs in ratios.items():
        finite = [r for r in rs if r == r]
        if finite:
            print(f"{hw}: milp / megatrain TFLOPS: min {min(finite):.2f}x, mean {sum(finite) / len(finite):.2f}x")

    print(f"\nLargest feasible micro-batch at seq {args.seq_len} (budget: 90% of device memory)")
    head = f"{'model':<14} {'hw':<8} {'milp':>6} {'megatrain':>9} {'gain':>6} {'search s':>8}"
    print(head)
    print("-" * len(head))
    for hw in args.max_batch_hardware:
        for model in args.models:
            cm = CostModel.from_config(get_config(model), hw, args.seq_len, 1, model_name=model)
            gpu, host = cm.hardware.default_gpu_budget(), cm.hardware.default_host_budget()
            t0 = time.perf_counter()
            b_milp = milp.max_feasible_batch(
                lambda b, cm=cm, gpu=gpu, host=host: milp.milp_feasible(
                    cm.with_batch(b), gpu, host, solver=args.solver
                ),
                args.max_batch_size,
            )
            b_mt = baselines.max_batch_size("megatrain", cm, gpu, host, args.max_batch_size)
            print(
                f"{model:<14} {hw:<8} {b_milp:>6} {b_mt:>9} {b_milp - b_mt:>+6} {time.perf_counter() - t0:>8.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
