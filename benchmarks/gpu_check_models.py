"""The model sections of ``gpu_check.py`` (4 and 5) and the profile calibration they need.

Per model size (`section_model`): per-layer forward / backward times measured through the streamed model
(`measure_layer_times`), the hardware profile calibrated from them (`calibrated_profile`), then for each GPU budget
the MILP plan, ``megatrain`` and ``keep_all`` at the largest batch each allows, each trained for a few real steps
(`train_steps`). `section_prediction` sets the stage model's and the simulator's step times against the measured
ones.

Imports ``gpu_check_common`` only; ``gpu_check.py`` imports it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import tempfile
import time
import traceback
import warnings
from typing import Any

import torch
from gpu_check_common import Budget, GiB, build_model, count_params, free_device_memory, log, make_batch, sync


# ---------------------------------------------------------------------------------------------------- section 3
def calibrated_profile(base, fwd: list[float], bwd: list[float], cm) -> tuple[Any, float]:
    """``base`` with ``achievable_fraction`` set from measured layer times: decoder-layer FLOP/s over the matmul
    peak (clamped to (0, 1]). The measured time already holds the memory-bound passes and kernel costs, so the
    profile's per-class terms (``efficiency``, ``memory_gbps``, ``kernel_overhead_s``) are dropped: one fitted rate,
    nothing counted twice."""
    flops = 3 * sum(lc.flops_fwd for lc in cm.layers)
    rate = flops / max(sum(fwd) + sum(bwd), 1e-12)
    eta = min(1.0, max(1e-3, rate / (base.peak_tflops * 1e12)))
    calibrated = dataclasses.replace(
        base,
        achievable_fraction=eta,
        layer_times={},
        layer_times_shape=[],
        efficiency={},
        memory_gbps=0.0,
        kernel_overhead_s=0.0,
    )
    return calibrated, eta


# ---------------------------------------------------------------------------------------------------- section 4
def measure_layer_times(model, device, batch, passes: int) -> tuple[list[float], list[float]]:
    """Per-layer forward / backward seconds of the streamed model, as the trainer's timed warm-up measures them
    (at least 2 passes: the first is dropped)."""
    from lazytrain_hf.training.planning import time_streamed_layers

    return time_streamed_layers(model, batch, device, max(2, passes))


def train_steps(model, plan, device, batch, warmup: int, steps: int, nvme_dir: str | None,
                budget_bytes: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Attach ``plan``, run ``warmup`` + ``steps`` real training steps, remove; median step time and peak memory.

    On CUDA with ``budget_bytes`` the caching allocator is held to the budget for the run
    (``torch.cuda.set_per_process_memory_fraction``, restored after), so a plan that needs more than it was planned
    for fails with an out-of-memory error instead of passing; both ``max_memory_allocated`` and
    ``max_memory_reserved`` (which also sees blocks whose free ``record_stream`` deferred) are reported.

    One step, as `LazyTrainer` puts it together: ``wait_resident`` -> streamed forward + chunked loss -> backward ->
    global grad norm -> clip coefficient -> `LayerwiseUpdater.run` (HybridAdamW8bit per layer + ``sync_compute``;
    on CUDA overlapping the next forward when the plan says so) -> ``zero_grad``.
    """
    from lazytrain_hf.optim import HybridAdamW8bit, clip_coefficient
    from lazytrain_hf.streaming import attach
    from lazytrain_hf.training.updater import LayerwiseUpdater

    t0 = time.perf_counter()
    enforced = device.type == "cuda" and budget_bytes is not None
    if enforced:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
    try:
        handle = attach(model, plan=plan, device=device, nvme_dir=nvme_dir)
    except BaseException:
        if enforced:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        raise
    overlap = bool(plan.optimizer_overlap and device.type == "cuda")  # the trainer's default (`_overlap_enabled`)
    updater = LayerwiseUpdater(handle, overlap=overlap)
    opt = None
    try:
        masters = [m for _, m in updater.named_masters()]
        opt = HybridAdamW8bit([{"params": masters, "weight_decay": 0.0}], lr=1e-5)
        updater.bind(opt)
        setup_s = time.perf_counter() - t0
        labels = batch["labels"]
        n_items = int((labels[:, 1:] != -100).sum())
        tokens = int(batch["attention_mask"].sum())  # non-pad tokens
        times: list[float] = []
        losses: list[float] = []
        norms: list[float] = []
        skipped = 0
        for k in range(warmup + steps):
            if k == warmup:
                updater.wait_all()
                sync(device)
                handle.reset_peak()
            sync(device)
            ts = time.perf_counter()
            updater.wait_resident()
            loss = handle.causal_lm_loss(model, batch, num_items_in_batch=n_items)
            loss.backward()
            norm = handle.global_grad_norm()
            if math.isfinite(norm):
                coef = clip_coefficient(norm, 1.0)
                updater.run(None if coef >= 1.0 else coef)
            else:
                skipped += 1  # as the trainer: a non-finite norm skips the update
            handle.zero_grad()
            sync(device)
            if k >= warmup:
                times.append(time.perf_counter() - ts)
                losses.append(float(loss.detach()))
                norms.append(norm)
        updater.wait_all()
        sync(device)
        stats = handle.memory_stats()
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else stats["device_peak_bytes"]
        reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
        step = statistics.median(times)
        return {
            "setup_s": setup_s,
            "step_times_s": times,
            "step_time_s": step,
            "tokens": tokens,
            "tokens_per_s": tokens / step,
            "losses": losses,
            "grad_norms": norms,
            "skipped_nonfinite": skipped,
            "peak_device_bytes": int(peak),
            "peak_source": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "executor accounted peak",
            "peak_reserved_bytes": None if reserved is None else int(reserved),
            "budget_enforced": enforced,
            "optimizer_overlap": overlap,
            "fetch_bytes": int(stats.get("fetch_bytes", 0)),
            "activation_cpu_bytes": int(stats.get("activation_cpu_bytes", 0)),
        }
    finally:
        updater.close()
        handle.remove()
        del opt, updater
        free_device_memory(device)
        if enforced:
            torch.cuda.set_per_process_memory_fraction(1.0, device)


def _plans_for_budget(cfg, name, profile, seq, b_t, times, budget, host_budget, max_batch, time_limit):
    """``[(label, plan, cost model at the plan's batch, note)]``: MILP at its largest feasible batch, megatrain and
    keep_all at theirs (skipped with a note when nothing fits)."""
    from lazytrain_hf.planner import baselines, milp
    from lazytrain_hf.planner.costmodel import CostModel

    cm_t = CostModel.from_config(cfg, profile, seq, b_t, 2, model_name=name).with_measured_times(*times)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            auto = milp.plan_for_model(
                cfg, profile, seq, micro_batch_size=b_t, auto_batch_size=True, gpu_budget=budget,
                host_budget=host_budget, max_batch_size=max_batch, time_limit=time_limit, measured_times=times,
            )  # fmt: skip
            b_max = int(auto.predicted.get("max_batch_size", auto.micro_batch_size))
            cm = cm_t.with_batch(b_max)
            plan = auto
            note = f"auto batch chose {auto.micro_batch_size} (best predicted tokens/s), largest feasible {b_max}"
            if auto.micro_batch_size != b_max:
                plan = milp.solve(cm, budget, host_budget, time_limit=time_limit)
            out.append(("milp", plan, cm, note))
        except milp.PlanInfeasibleError as e:
            out.append(("milp", None, None, f"infeasible: {e}"))
        for bl in ("megatrain", "keep_all"):
            b = baselines.max_batch_size(bl, cm_t, budget, host_budget, max_batch)
            if b == 0:
                out.append((bl, None, None, "does not fit the budget at batch 1"))
                continue
            cm = cm_t.with_batch(b)
            note = ""
            if bl == "megatrain":
                note = f"block recompute (K={baselines.MEGATRAIN_CHECKPOINT_EVERY}), optimizer after backward"
            out.append((bl, baselines.make_baseline(bl, cm), cm, note))
    return out


def section_model(
    name: str, cfg: Any, device: torch.device, profile, args, budget: Budget, out_dir: str
) -> dict[str, Any]:
    import psutil

    from lazytrain_hf.planner import simulate
    from lazytrain_hf.planner.costmodel import CostModel
    from lazytrain_hf.units import parse_bytes

    seq = args.seq_len
    res: dict[str, Any] = {"model": name, "seq_len": seq, "dtype": "bfloat16", "runs": [], "notes": []}
    cm1 = CostModel.from_config(cfg, profile, seq, 1, 2, model_name=name)
    need = cm1.host_state_bytes + 2 * cm1.total_params  # host state + the bf16 model while it is built
    avail = psutil.virtual_memory().available
    res["host_estimate_bytes"] = int(need)
    if need > 0.9 * avail:
        res["notes"].append(f"skipped: needs ~{need / GiB:.1f} GiB host memory, {avail / GiB:.1f} GiB available")
        log("   " + res["notes"][-1])
        return res
    t0 = time.perf_counter()
    model = build_model(cfg, torch.bfloat16, device)
    res["build_s"] = time.perf_counter() - t0
    res["num_params"] = count_params(model)
    log(f"   built {name}: {res['num_params'] / 1e9:.3f}B params in {res['build_s']:.1f} s")

    b_t = args.timing_batch
    t0 = time.perf_counter()
    fwd, bwd = measure_layer_times(model, device, make_batch(cfg.vocab_size, b_t, seq, device), args.timing_passes)
    res["layer_times"] = {"batch": b_t, "seq_len": seq, "fwd_s": fwd, "bwd_s": bwd}
    res["layer_timing_s"] = time.perf_counter() - t0
    prof, eta = calibrated_profile(profile, fwd, bwd, cm1.with_batch(b_t))
    res["achievable_fraction"] = eta
    per_kind: dict[str, list[float]] = {}
    for lc, f, b in zip(cm1.layers, fwd, bwd):
        per_kind.setdefault(lc.kind, [f, b])
    model_prof = dataclasses.replace(prof, name=f"{profile.name}-{name}", layer_times=per_kind,
                                     layer_times_shape=[b_t, seq])  # fmt: skip
    res["profile_path"] = os.path.join(out_dir, f"measured_profile_{name}.json")
    model_prof.to_json(res["profile_path"])
    log(f"   layer times at {b_t}x{seq}: fwd {sum(fwd) * 1e3:.1f} ms, bwd {sum(bwd) * 1e3:.1f} ms, eta {eta:.3f}")

    host_budget = int(max(GiB // 64, min(prof.default_host_budget(), 0.5 * (avail - need))))
    setup_s = res["layer_timing_s"]  # attach cost of the last run (first guess: the timing passes)
    with tempfile.TemporaryDirectory(prefix="gpu_check_nvme_") as nvme:
        for btext in args.budgets:
            gpu_budget = parse_bytes(btext, "--budgets")
            t0 = time.perf_counter()
            plans = _plans_for_budget(
                cfg, name, prof, seq, b_t, (fwd, bwd), gpu_budget, host_budget, args.max_batch, args.solver_time_limit
            )
            plan_s = time.perf_counter() - t0
            for label, plan, cm, note in plans:
                row: dict[str, Any] = {"budget": btext, "budget_bytes": gpu_budget, "plan": label, "note": note,
                                       "planning_s": plan_s}  # fmt: skip
                res["runs"].append(row)
                if plan is None:
                    row["status"] = "skipped"
                    log(f"   {btext:>7} {label:<10} skipped: {note}")
                    continue
                sim = simulate.simulate(plan, cm)
                row.update(
                    batch=plan.micro_batch_size,
                    policies={p: plan.policies.count(p) for p in sorted(set(plan.policies))},
                    resident_layers=sum(lp.resident for lp in plan.layers),
                    predicted_step_s=float(plan.predicted["step_time_s"]),
                    predicted_peak_bytes=int(plan.predicted["peak_gpu_bytes"]),
                    simulated_step_s=float(sim.step_time_s),
                    solver=plan.solver,
                )
                estimate = budget.run_estimate(sim.step_time_s, args.warmup + args.steps, setup_s)
                if not budget.allows(estimate):
                    row["status"] = "skipped"
                    row["note"] = (
                        f"time budget: {budget.elapsed():.0f} s of {budget.seconds:.0f} s spent, run needs ~"
                        f"{estimate:.0f} s" + (f"; {note}" if note else "")
                    )
                    log(f"   {btext:>7} {label:<10} skipped: {row['note']}")
                    continue
                batch = make_batch(cfg.vocab_size, plan.micro_batch_size, seq, device)
                try:
                    m = train_steps(model, plan, device, batch, args.warmup, args.steps, nvme, gpu_budget)
                except Exception as e:  # one failing run does not lose the others
                    row.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
                    log(f"   {btext:>7} {label:<10} failed: {type(e).__name__}: {e}")
                    free_device_memory(device)
                    continue
                row.update(m, status="ok")
                budget.slowdowns.append(m["step_time_s"] / max(sim.step_time_s, 1e-9))
                setup_s = m["setup_s"]
                row["tflops"] = 6 * res["num_params"] * m["tokens"] / m["step_time_s"] / 1e12
                row["within_budget"] = m["peak_device_bytes"] <= gpu_budget
                # what the allocator really held (deferred frees included); None on the CPU
                row["reserved_within_budget"] = (
                    None if m["peak_reserved_bytes"] is None else m["peak_reserved_bytes"] <= gpu_budget
                )
                row["milp_err_pct"] = 100 * (row["predicted_step_s"] - m["step_time_s"]) / m["step_time_s"]
                row["sim_err_pct"] = 100 * (row["simulated_step_s"] - m["step_time_s"]) / m["step_time_s"]
                log(
                    f"   {btext:>7} {label:<10} B={plan.micro_batch_size:<3} step {m['step_time_s']:.3f} s "
                    f"(pred {row['predicted_step_s']:.3f}, sim {row['simulated_step_s']:.3f}) "
                    f"{row['tflops']:.3f} TFLOPS peak {m['peak_device_bytes'] / GiB:.3f} GiB loss {m['losses'][-1]:.3f}"
                )
    del model
    free_device_memory(device)
    return res


# ---------------------------------------------------------------------------------------------------- section 5
def section_prediction(model_results: list[dict]) -> dict[str, Any]:
    rows = []
    for res in model_results:
        for r in res.get("runs", []):
            if r.get("status") != "ok":
                continue
            rows.append(
                {
                    "model": res["model"],
                    "budget": r["budget"],
                    "plan": r["plan"],
                    "batch": r["batch"],
                    "measured_s": r["step_time_s"],
                    "milp_s": r["predicted_step_s"],
                    "sim_s": r["simulated_step_s"],
                    "milp_err_pct": r["milp_err_pct"],
                    "sim_err_pct": r["sim_err_pct"],
                }
            )
    errs = [abs(r["milp_err_pct"]) for r in rows]
    sims = [abs(r["sim_err_pct"]) for r in rows]
    out = {
        "rows": rows,
        "max_abs_milp_err_pct": max(errs) if errs else None,
        "max_abs_sim_err_pct": max(sims) if sims else None,
        "median_abs_milp_err_pct": statistics.median(errs) if errs else None,
    }
    for r in rows:
        log(
            f"   {r['model']:<16} {r['budget']:>7} {r['plan']:<10} measured {r['measured_s']:.4f} s  "
            f"milp {r['milp_s']:.4f} ({r['milp_err_pct']:+.1f}%)  sim {r['sim_s']:.4f} ({r['sim_err_pct']:+.1f}%)"
        )
    return out
