"""Planner benchmark: the MILP plan vs MegaTrain (modelled from its own executor) per zoo model x hardware.

    python benchmarks/bench_planner.py                       # all zoo models on h800, h100 (when bundled), rtx3090
    python benchmarks/bench_planner.py --models qwen3-8b --hardware h800 --batch h800=8 --time-limit 5

Everything is model-only (no GPU): the MILP plan's TFLOPS are its stage-model prediction (``plan.predicted``, the
simulator's disagreement with it in "sim err"), megatrain's come from `baselines.evaluate_megatrain` (MegaTrain's
executor as its code does it: 3 forwards and 3 weight crossings per layer, exposed fetches in recompute / backward,
serial CPU optimizer); "mt ovl" is the same with the backward fetches overlapped (the host running ahead).

Prints three tables at seq 1024:
1. at a fixed micro-batch per hardware (and the paper's MetaMathQA point, Qwen3.6-27B on h800 at batch 72): TFLOPS
   of the MILP plan (the embedding and head resident or streamed, whichever is faster: "emb") and of megatrain in
   the hardware convention (``tflops``: useful FLOPs, recomputation excluded) and in MegaTrain's ``6 * N * B * T``
   convention (``tflops_6n``), and the ratio; and the strongest baseline of `baselines.BASELINES` run by our executor
   (megatrain, megatrain_plus, slideformer, ...: the fastest that fits) with its step over the MILP's, both replayed
   by the simulator;
2. the largest feasible micro-batch of each (budget: 90% of device memory; MILP: activations on the device or in
   pinned host memory, and "gpu only": on the device only, as megatrain; both the larger of the embedding and head
   resident or streamed, as ``lazytrain plan --stream-embeddings auto`` plans; "gpu res": device only, resident);
3. the ratio at megatrain's own largest batch (both plans at that batch), and to the strongest baseline there.

The ratio is the same in both conventions: at one sequence length both numerators are proportional to the tokens of
a step (printed once).
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
from lazytrain_hf.planner.hardware import get_profile  # noqa: E402
from lazytrain_hf.planner.memmodel import with_streamed_embeddings  # noqa: E402
from lazytrain_hf.planner.simulate import simulate  # noqa: E402
from lazytrain_hf.planner.zoo import ZOO_MODELS, get_config  # noqa: E402

DEFAULT_BATCH = {"h800": 8, "h100": 8, "h200": 8, "a100-80g": 4, "rtx3090": 2, "rtx4090": 2, "cpu": 1}
PAPER_POINT = ("qwen3.6-27b", "h800", 72)  # MetaMathQA: 219.95 TFLOPS, 1361 tokens/s, 68.84 GB peak


def tflops_6n(cm: CostModel, step_s: float) -> float:
    """MegaTrain's convention (examples/sft/train.py): 6 * N * B * T / step, N every parameter."""
    return 6 * cm.total_params * cm.tokens / step_s / 1e12


def solve(cm: CostModel, args: argparse.Namespace):
    """The MILP plan at the default budgets with the embedding and head resident and streamed, the one with the higher
    predicted tokens/s kept (resident on a tie), as ``lazytrain plan --stream-embeddings auto`` chooses."""
    gpu, host = cm.hardware.default_gpu_budget(), cm.hardware.default_host_budget()
    t0 = time.perf_counter()
    try:
        plan = milp.better_of_embeddings(
            lambda on: milp.solve(
                with_streamed_embeddings(cm, on), gpu_budget=gpu, host_budget=host, time_limit=args.time_limit,
                solver=args.solver,
            )
        )  # fmt: skip
    except milp.PlanInfeasibleError as e:
        need = "-" if e.min_gpu_budget is None else f"{e.min_gpu_budget / 2**30:.1f} GiB"
        return None, need, time.perf_counter() - t0
    return plan, "", time.perf_counter() - t0


def row(cm: CostModel, model: str, hw: str, args: argparse.Namespace) -> str:
    gpu, host = cm.hardware.default_gpu_budget(), cm.hardware.default_host_budget()
    B = cm.micro_batch_size
    plan, need, solve_s = solve(cm, args)
    mt_plan = baselines.make_baseline("megatrain", cm)
    mt = mt_plan.predicted if baselines.fits(mt_plan, cm, gpu, host) else None
    ovl = baselines.evaluate_megatrain(cm, overlap_backward_fetches=True) if mt else None
    cells = [f"{model:<14} {hw:<8} {B:>3}"]
    if plan is None:
        cells.append(f"{'infeasible, needs ' + need:>33}")
    else:
        p = plan.predicted
        sim = simulate(plan, with_streamed_embeddings(cm, plan.stream_embeddings))
        err = (p["step_time_s"] - sim.step_time_s) / p["step_time_s"]
        cells.append(f"{p['tflops']:>7.1f} {tflops_6n(cm, p['step_time_s']):>7.1f} {100 * err:>+7.2f}%")
    if mt is None:
        peak = baselines.evaluate_megatrain(cm).peak_gpu_bytes
        cells.append(f"{'does not fit (' + f'{peak / 1e9:.1f} GB)':>31}")
    else:
        cells.append(
            f"{mt['tflops']:>7.1f} {mt['tflops_6n']:>7.1f} {ovl.tflops:>7.1f} {mt['peak_gpu_bytes'] / 1e9:>7.1f}"
        )
    if plan is not None and mt is not None:
        cells.append(f"{mt['step_time_s'] / plan.predicted['step_time_s']:>6.2f}x")
        cells.append(f"{ovl.step_time_s / plan.predicted['step_time_s']:>6.2f}x")
    else:
        cells.append(f"{'-':>7} {'-':>7}")
    status = f"{plan.solver['name']} {plan.solver['status']}" if plan is not None else "-"
    emb = "-" if plan is None else ("str" if plan.stream_embeddings else "res")
    cells.append(f"{status:>18} {emb:>4} {solve_s:>6.1f}")
    name, best_s = strongest_baseline(cm)
    if plan is not None and best_s is not None:
        cells.append(f"{name:>18} {best_s / sim.step_time_s:>6.2f}x")
    else:
        cells.append(f"{name or 'none fits':>18} {'-':>7}")
    return " ".join(cells)


def strongest_baseline(cm: CostModel) -> tuple[str | None, float | None]:
    """The fastest plan of `baselines.BASELINES` (run by our executor, the embedding and head resident) that fits the
    default budgets by the stage model, and its step time replayed by the simulator (``(None, None)``: none fits)."""
    gpu, host = cm.hardware.default_gpu_budget(), cm.hardware.default_host_budget()
    best: tuple[str | None, float | None] = (None, None)
    for name in baselines.BASELINES:
        plan = baselines.baseline_plan(name, cm)
        if baselines.fits(plan, cm, gpu, host):
            t = simulate(plan, cm).step_time_s
            if best[1] is None or t < best[1]:
                best = (name, t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=list(ZOO_MODELS))
    ap.add_argument("--hardware", nargs="*", default=["h800", "h100", "rtx3090"])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", nargs="*", default=[], help="per-hardware micro-batch, e.g. h800=8")
    ap.add_argument("--time-limit", type=float, default=5.0)
    ap.add_argument("--solver", default="auto")
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--no-paper-point", action="store_true", help="skip Qwen3.6-27B on h800 at batch 72")
    args = ap.parse_args()
    batch = dict(DEFAULT_BATCH)
    for item in args.batch:
        k, v = item.split("=")
        batch[k] = int(v)
    warnings.simplefilter("ignore")
    hardware = []
    for hw in args.hardware:
        try:
            get_profile(hw)
            hardware.append(hw)
        except ValueError:
            print(f"note: no bundled hardware profile {hw!r} here; its rows are skipped.")

    head = (
        f"{'model':<14} {'hw':<8} {'B':>3} {'milp':>7} {'6N':>7} {'sim err':>8} {'mt':>7} {'6N':>7} {'mt ovl':>7} "
        f"{'mt GB':>7} {'ratio':>7} {'r ovl':>7} {'solver':>18} {'emb':>4} {'solve s':>6} {'strongest':>18} "
        f"{'vs it':>7}"
    )
    print(f"1. TFLOPS at seq {args.seq_len}: MILP (stage model) vs megatrain (its executor's model); ratio = step "
          "time megatrain / MILP, the same in both conventions; strongest: the fastest baseline run by our executor "
          "that fits, 'vs it' its step / the MILP's, both replayed by the simulator")  # fmt: skip
    print(head)
    print("-" * len(head))
    for hw in hardware:
        for model in args.models:
            cm = CostModel.from_config(get_config(model), hw, args.seq_len, batch[hw], model_name=model)
            print(row(cm, model, hw, args), flush=True)
    if not args.no_paper_point and PAPER_POINT[1] in hardware:
        model, hw, b = PAPER_POINT
        cm = CostModel.from_config(get_config(model), hw, args.seq_len, b, model_name=model)
        print(row(cm, model, hw, args) + "   <- paper's MetaMathQA batch", flush=True)

    print(f"\n2./3. Largest feasible micro-batch at seq {args.seq_len} (budget 90% of device memory; cap "
          f"{args.max_batch_size}) and the ratio at megatrain's largest batch")  # fmt: skip
    head = (
        f"{'model':<14} {'hw':<8} {'milp':>6} {'gpu only':>8} {'gpu res':>7} {'megatrain':>9} {'gain':>6} "
        f"{'milp@Bmt':>8} {'mt@Bmt':>7} "
        f"{'6N milp':>7} {'6N mt':>7} {'ratio':>7} {'strongest':>15} {'vs it':>7} {'search s':>8}"
    )
    print(head)
    print("-" * len(head))
    for hw in hardware:
        for model in args.models:
            cm = CostModel.from_config(get_config(model), hw, args.seq_len, 1, model_name=model)
            gpu, host = cm.hardware.default_gpu_budget(), cm.hardware.default_host_budget()
            t0 = time.perf_counter()
            largest = {}  # (tiers, embedding and head streamed) -> largest feasible micro-batch
            for tiers in (("gpu", "cpu"), ("gpu",)):
                for on in (False, True):
                    scm = with_streamed_embeddings(cm, on)
                    largest[tiers, on] = milp.max_feasible_batch(
                        lambda b, scm=scm, gpu=gpu, host=host, tiers=tiers: milp.milp_feasible(
                            scm.with_batch(b), gpu, host, allowed_tiers=tiers, solver=args.solver
                        ),
                        args.max_batch_size,
                    )
            b_milp = max(largest[("gpu", "cpu"), on] for on in (False, True))
            b_gpu, b_res = max(largest[("gpu",), on] for on in (False, True)), largest[("gpu",), False]
            b_mt = baselines.max_batch_size("megatrain", cm, gpu, host, args.max_batch_size)
            cells = f"{model:<14} {hw:<8} {b_milp:>6} {b_gpu:>8} {b_res:>7} {b_mt:>9} {b_milp - b_mt:>+6}"
            if b_mt:
                cmb = cm.with_batch(b_mt)
                plan, _, _ = solve(cmb, args)
                mt = baselines.make_baseline("megatrain", cmb).predicted
                name, best_s = strongest_baseline(cmb)
                if plan is not None:
                    p = plan.predicted
                    sim_s = simulate(plan, with_streamed_embeddings(cmb, plan.stream_embeddings)).step_time_s
                    vs = f"{best_s / sim_s:>6.2f}x" if best_s is not None else f"{'-':>7}"
                    cells += (
                        f" {p['tflops']:>8.1f} {mt['tflops']:>7.1f} {tflops_6n(cmb, p['step_time_s']):>7.1f} "
                        f"{mt['tflops_6n']:>7.1f} {mt['step_time_s'] / p['step_time_s']:>6.2f}x {name or '-':>15} {vs}"
                    )
                else:
                    cells += (
                        f" {'-':>8} {mt['tflops']:>7.1f} {'-':>7} {mt['tflops_6n']:>7.1f} {'-':>7} {'-':>15} {'-':>7}"
                    )
            print(cells + f" {time.perf_counter() - t0:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
