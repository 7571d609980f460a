"""The cost model on the CPU device: measured training steps against the planner's prediction, per plan and size.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_cpu_predict.py                       # ~40M, ~100M, ~300M qwen3
    PYTHONPATH=. .venv/bin/python benchmarks/bench_cpu_predict.py --sizes 40m --steps 3 --json /tmp/cpu_predict.json

For each size (qwen3 built from a config with transformers, random init, fp32, untied embeddings):

1. ``hardware.measure(device="cpu", config=...)``: this machine's profile at the model's layer shapes (GEMM rate,
   attention, batched matmuls, memory-bound passes, kernel cost, copy bandwidth, optimizer rate), measured again
   just before each plan runs (the load of a shared machine changes by the minute); its measured per-kind layer
   times are kept aside (printed against the cost model's analytic ones) and removed from the profile, so every
   prediction comes from `CostModel.from_config`'s per-class terms.
2. The plans: ``keep_all`` and ``megatrain`` (`baselines.make_baseline`) and the MILP plan (`milp.solve`) under a
   device budget of 60% of keep_all's peak, so that it must stream, offload or recompute.
3. Each plan trained for ``--warmup`` + ``--steps`` real steps as `LazyTrainer` puts one together (streamed
   forward and chunked loss, backward, global norm, clip, `LayerwiseUpdater` with `HybridAdamW8bit`, ``zero_grad``),
   the trace's step boundary after each; median step time.
4. Predictions: ``stage`` = `stages.evaluate_plan(plan, cm).step_time_s` (lanes overlap, optimizer overlapped when
   the plan says so); ``serial`` = what the stage model gives on a profile with ``serial_lanes`` (Note: [Serial
   lanes on the CPU device], hardware.py): the compute of every stage (forward, head, backward, recomputation)
   plus the step's copies at the measured bandwidths (bytes from the executor's trace) plus the whole optimizer.

Threads and clock: ``--threads`` (default 1) for measurement and training alike, and ``--clock process`` (default):
probes and steps are timed by this process's CPU time (`time.process_time`), which on a shared 2-core machine counts
what the work costs whatever the other tenants run (the wall clock of a step there swings 2-3x within a minute);
``--clock wall`` on a quiet machine. The load average is printed with each plan.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# name: (hidden, layers, heads, kv heads, intermediate, micro-batch, seq)
SIZES: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "40m": (512, 8, 8, 4, 1536, 2, 256),
    "100m": (768, 12, 12, 4, 2048, 2, 256),
    "300m": (1024, 20, 16, 8, 3072, 1, 256),
}
VOCAB = 16384
MILP_BUDGET_FRACTION = 0.6
CLOCK = [time.process_time]  # --clock: process CPU time (default) or wall time


def qwen3_config(name: str):
    from transformers import AutoConfig

    d, L, H, kv, inner, _, _ = SIZES[name]
    cfg = AutoConfig.for_model(
        "qwen3",
        hidden_size=d,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=kv,
        head_dim=64,
        intermediate_size=inner,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
        use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def plans_for(cm, name: str):
    from lazytrain_hf.planner import baselines, milp
    from lazytrain_hf.planner.stages import evaluate_plan

    keep = baselines.make_baseline("keep_all", cm)
    mega = baselines.make_baseline("megatrain", cm)
    budget = int(evaluate_plan(keep, cm).peak_gpu_bytes * MILP_BUDGET_FRACTION)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plan = milp.solve(cm, gpu_budget=budget, time_limit=20)
        except milp.PlanInfeasibleError as e:
            plan = milp.solve(cm, gpu_budget=e.min_gpu_budget, time_limit=20)
    return [("keep_all", keep), ("megatrain", mega), ("milp", plan)]


def run_plan(model, plan, batch, warmup: int, steps: int) -> dict[str, Any]:
    """Attach, train ``warmup + steps`` steps (one step as `LazyTrainer`), remove. Median step time and the
    trace's bytes per lane of the last step."""
    from lazytrain_hf.optim import HybridAdamW8bit, clip_coefficient
    from lazytrain_hf.streaming import attach
    from lazytrain_hf.training.updater import LayerwiseUpdater

    device = torch.device("cpu")
    handle = attach(model, plan=plan, device=device)
    updater = LayerwiseUpdater(handle, overlap=False)  # the trainer's choice on CPU (`_overlap_enabled`)
    try:
        opt = HybridAdamW8bit([{"params": [m for _, m in updater.named_masters()], "weight_decay": 0.0}], lr=1e-5)
        updater.bind(opt)
        n_items = int((batch["labels"][:, 1:] != -100).sum())
        times = []
        clock = CLOCK[0]
        for k in range(warmup + steps):
            t0 = clock()
            updater.wait_resident()
            loss = handle.causal_lm_loss(model, batch, num_items_in_batch=n_items)
            loss.backward()
            norm = handle.global_grad_norm()
            if math.isfinite(norm):
                coef = clip_coefficient(norm, 1.0)
                updater.run(None if coef >= 1.0 else coef)
            handle.zero_grad()
            updater.wait_all()
            trace = getattr(handle, "trace", None)
            if trace is not None:
                trace.end_step()
            if k >= warmup:
                times.append(clock() - t0)
        last = handle.trace.steps[-1]["bytes"] if getattr(handle, "trace", None) is not None else None
        return {"step_s": statistics.median(times), "times": times, "bytes": last}
    finally:
        updater.close()
        handle.remove()


def serial_prediction(plan, cm, lane_bytes: dict[str, int] | None) -> float:
    """Step time when no lane overlaps another (the CPU device): all compute, then the copies, then the optimizer."""
    comp = cm.head_s
    for lp, lc in zip(plan.layers, cm.layers):
        comp += lc.fwd_s + lc.bwd_s + (lc.fwd_s if lp.policy == "recompute" else 0.0)
    copies = 0.0
    if lane_bytes is not None:
        copies = lane_bytes["h2d"] / cm.h2d + lane_bytes["d2h"] / cm.d2h
        copies += lane_bytes["nvme_read"] / cm.nvme_r + lane_bytes["nvme_write"] / cm.nvme_w
    opt = cm.total_params / cm.hardware.cpu_optimizer_params_per_s
    return comp + copies + opt


def bench_size(name: str, warmup: int, steps: int) -> dict[str, Any]:
    import dataclasses

    from gpu_check_common import build_model, count_params, make_batch

    from lazytrain_hf.planner import hardware
    from lazytrain_hf.planner.costmodel import CostModel
    from lazytrain_hf.planner.stages import evaluate_plan

    cfg = qwen3_config(name)
    B, T = SIZES[name][5], SIZES[name][6]

    def profile_now():
        p = hardware.measure(
            device="cpu", config=cfg, micro_batch_size=B, seq_len=T, use_cache=False, repeats=3, timer=CLOCK[0]
        )
        layer = p.layer_times["full_attention"]
        p = dataclasses.replace(p, layer_times={}, layer_times_shape=[])
        return p, CostModel.from_config(cfg, p, T, B, dtype_bytes=4, model_name=f"qwen3-{name}"), layer

    prof, cm, _ = profile_now()
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    batch = make_batch(VOCAB, B, T, torch.device("cpu"))
    out = {"size": name, "params": count_params(model), "batch": [B, T], "plans": []}
    print(f"[{name}] {out['params'] / 1e6:.0f}M params, B={B} T={T}", flush=True)
    for label, plan in plans_for(cm, name):
        # the profile is measured again just before each plan runs: on a shared machine the load changes by the
        # minute (CPU time removes most of that, not the other tenants' use of the memory bus)
        load = os.getloadavg()[0]
        prof, cm_now, (mf, mb) = profile_now()
        lc = cm_now.layers[0]
        res = run_plan(model, plan, batch, warmup, steps)
        stage = evaluate_plan(plan, cm_now).step_time_s
        serial = serial_prediction(plan, cm_now, res["bytes"])
        row = {
            "plan": label,
            "load_avg_1m": load,
            "profile": prof.to_dict(),
            "layer": {"pred_fwd_s": lc.fwd_s, "pred_bwd_s": lc.bwd_s, "meas_fwd_s": mf, "meas_bwd_s": mb},
            "measured_s": res["step_s"],
            "times_s": res["times"],
            "stage_pred_s": stage,
            "serial_pred_s": serial,
            "stage_ratio": stage / res["step_s"],
            "serial_ratio": serial / res["step_s"],
            "bytes": res["bytes"],
        }
        out["plans"].append(row)
        print(
            f"[{name}] {label:10s} load {load:.1f}; profile: GEMM {prof.peak_tflops * 1e3:.0f} GFLOP/s, "
            f"{', '.join(f'{k} {v:.2f}' for k, v in prof.efficiency.items())}, BW_mem {prof.memory_gbps:.1f} GB/s, "
            f"kernel {prof.kernel_overhead_s * 1e6:.1f} us, copy {prof.h2d_gbps:.1f} GB/s, optimizer "
            f"{prof.cpu_optimizer_params_per_s / 1e6:.0f} Mparam/s",
            flush=True,
        )
        print(
            f"[{name}] {label:10s} decoder layer fwd / bwd: predicted {lc.fwd_s * 1e3:.1f} / {lc.bwd_s * 1e3:.1f} ms, "
            f"measured {mf * 1e3:.1f} / {mb * 1e3:.1f} ms (ratio {lc.fwd_s / mf:.2f} / {lc.bwd_s / mb:.2f})",
            flush=True,
        )
        print(
            f"[{name}] {label:10s} step measured {res['step_s']:.3f} s | stage {stage:.3f} s ({row['stage_ratio']:.2f})"
            f" | serial {serial:.3f} s ({row['serial_ratio']:.2f})",
            flush=True,
        )
    del model
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="40m,100m,300m", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--clock",
        choices=("process", "wall"),
        default="process",
        help="time steps and probes by this process's CPU time (steady on a shared machine) or by the wall clock",
    )
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        raise SystemExit(f"--sizes: unknown size {bad[0]!r}; use {', '.join(SIZES)}.")
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        raise SystemExit("--steps must be >= 1, --warmup >= 0, --threads >= 1.")
    torch.set_num_threads(args.threads)
    CLOCK[0] = time.process_time if args.clock == "process" else time.perf_counter
    torch.manual_seed(0)
    t0 = time.perf_counter()
    results = [bench_size(s, args.warmup, args.steps) for s in sizes]
    print()
    print(f"{'size':6s} {'plan':10s} {'measured s':>10s} {'stage s':>8s} {'ratio':>6s} {'serial s':>8s} {'ratio':>6s}")
    for r in results:
        for p in r["plans"]:
            print(
                f"{r['size']:6s} {p['plan']:10s} {p['measured_s']:10.3f} {p['stage_pred_s']:8.3f} "
                f"{p['stage_ratio']:6.2f} {p['serial_pred_s']:8.3f} {p['serial_ratio']:6.2f}"
            )
    print(f"total {time.perf_counter() - t0:.0f} s wall, threads {args.threads}, clock {args.clock}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
