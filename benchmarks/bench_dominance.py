"""The MILP against the strongest baseline, per zoo model x hardware x sequence x budget x tiers (model-only, no GPU).

    python benchmarks/bench_dominance.py                                  # the issue-26 grid on 5 profiles
    python benchmarks/bench_dominance.py --models qwen2.5-7b --hardware h800 --seq-len 1024 --budgets 0.9

Every plan is judged by the simulator (`lazytrain_hf.planner.simulate`, the executor's own transfer schedule on
lanes) and must fit the stage model too (`lazytrain_hf.planner.dominance`). Per row: the largest micro-batch of the
MILP and of the strongest baseline (the largest batch; among equals the fastest there, simulated); at the common
batch (every baseline fits) the simulated step of the fastest baseline over the MILP's ("speedup", > 1: the MILP is
faster) and the same ratio by the stage model ("stage"); "@B best": the strongest baseline's simulated step over the
MILP's at that baseline's largest batch. A row that breaks dominance is followed by its violations (``!``).
Baselines: every one of `baselines.BASELINES` that uses only the row's tiers (megatrain, megatrain_plus, slideformer,
all_recompute, keep_all, cpu_offload_inputs), each run by our executor. The last line summarises.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lazytrain_hf.planner.baselines import baseline_plan  # noqa: E402
from lazytrain_hf.planner.costmodel import CostModel  # noqa: E402
from lazytrain_hf.planner.dominance import dominance_record  # noqa: E402
from lazytrain_hf.planner.simulate import simulate  # noqa: E402
from lazytrain_hf.planner.zoo import get_config  # noqa: E402

GRID_MODELS = ["qwen2.5-7b", "qwen2.5-32b", "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b", "qwen3.6-27b"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=GRID_MODELS)
    ap.add_argument("--hardware", nargs="*", default=["h800", "h200", "a100-80g", "rtx3090", "rtx4090"])
    ap.add_argument("--seq-len", nargs="*", type=int, default=[1024, 4096])
    ap.add_argument("--budgets", nargs="*", type=float, default=[0.5, 0.9], help="fractions of device memory")
    ap.add_argument("--tiers", nargs="*", default=["gpu", "gpu,cpu"])
    ap.add_argument("--time-limit", type=float, default=5.0)
    ap.add_argument("--max-batch-size", type=int, default=256)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    head = (
        f"{'model':<14} {'hw':<8} {'seq':>5} {'bud':>4} {'tiers':<7} {'B milp':>6} {'B best':>6} {'best baseline':<18} "
        f"{'B@':>4} {'fastest baseline':<18} {'speedup':>7} {'stage':>6} {'@B best':>7} {'s':>5}"
    )
    print(head)
    print("-" * len(head))
    speedups, top_speedups, batch_gain, violations, rows = [], [], [], 0, 0
    for model in args.models:
        for hw in args.hardware:
            for seq in args.seq_len:
                for budget in args.budgets:
                    for tiers in args.tiers:
                        t0 = time.perf_counter()
                        rec = dominance_record(
                            model,
                            hw,
                            seq,
                            budget,
                            tuple(tiers.split(",")),
                            max_batch=args.max_batch_size,
                            time_limit=args.time_limit,
                        )
                        rows += 1
                        bad = rec.violations()
                        violations += bool(bad)
                        base = {k: v for k, v in rec.max_batch.items() if k != "milp"}
                        b_best = max(base.values())
                        # the strongest baseline: the largest batch, then the fastest (simulated) at that batch
                        cmb = CostModel.from_config(get_config(model), hw, seq, max(b_best, 1))
                        step = {k: simulate(baseline_plan(k, cmb), cmb).step_time_s for k in base if base[k] == b_best}
                        best = min(step, key=step.get) if b_best else "-"
                        cells = (
                            f"{model:<14} {hw:<8} {seq:>5} {budget:>4.2f} {tiers:<7} {rec.max_batch['milp']:>6} "
                            f"{b_best:>6} {best:<18}"
                        )
                        if b_best:
                            batch_gain.append(rec.max_batch["milp"] / b_best)
                        fit = {k: v for k, v in rec.step_s.items() if k != "milp" and v is not None}
                        if rec.step_s.get("milp") and fit:
                            fast = min(fit, key=fit.get)
                            sp = fit[fast] / rec.step_s["milp"]
                            st = rec.stage_s[fast] / rec.stage_s["milp"]
                            speedups.append(sp)
                            cells += f" {rec.common_batch:>4} {fast:<18} {sp:>6.3f}x {st:>5.3f}x"
                        else:
                            what = "milp plan misfits" if fit else "nothing fits"
                            cells += f" {rec.common_batch or '-':>4} {what:<18} {'-':>7} {'-':>6}"
                        top = rec.milp_plans.get("top")
                        if b_best and top is not None and rec.max_batch["milp"] >= b_best:
                            at_best = step[best] / simulate(top, cmb).step_time_s
                            top_speedups.append(at_best)
                            cells += f" {at_best:>6.3f}x"
                        else:
                            cells += f" {'-':>7}"
                        print(
                            cells + f" {time.perf_counter() - t0:>5.1f}" + "".join(f"\n   ! {v}" for v in bad),
                            flush=True,
                        )
    if speedups:
        print(
            f"\n{rows} rows, {violations} with a violation (`DominanceRecord.violations`); simulated speedup over the "
            f"fastest baseline at the common batch: median {statistics.median(speedups):.3f}x, min {min(speedups):.3f}x,"
            f" max {max(speedups):.3f}x; largest batch MILP / strongest baseline: median "
            f"{statistics.median(batch_gain):.3f}, min {min(batch_gain):.3f}; at the strongest baseline's largest batch: "
            f"median {statistics.median(top_speedups):.3f}x, min {min(top_speedups):.3f}x, max {max(top_speedups):.3f}x"
        )


if __name__ == "__main__":
    main()
