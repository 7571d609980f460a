"""The ``plan_space`` section of ``gpu_check.py``: parity and timing over the plan space, then the CUDA stream
sanitizer pass.

Each case (`PLAN_SPACE_CASES`, built by `plan_space_case`) trains a small qwen3 through
``LazyTrainer(planner_plan=...)`` (`plan_space_train`) and is compared (`compare_runs`) with the keep-all, no-overlap
reference of the same gradient accumulation, dtype and stream_embeddings (`plan_space_reference_plan`): bit-exact
when two runs of the reference agree on the device, otherwise within `PLAN_SPACE_RTOL`. `section_plan_space` runs
the cases (`plan_space_cases_run`), then every case once more in a child process of ``gpu_check.py``
(``--plan-space-child``, which runs `plan_space_child`) under ``TORCH_CUDA_SANITIZER=1``. `plan_space_line` is the
section's line of the summary. ``gpu_check_cuda.py`` reuses the sizes, the training and the comparison.

Imports ``gpu_check_common`` only; ``gpu_check.py`` and ``gpu_check_cuda.py`` import it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
from gpu_check_common import Budget, build_model, free_device_memory, log, sync, tiny_hf_config

# ---------------------------------------------------------------------------------------------------- plan space
# Each case: (plan shape, gradient accumulation, dtype, stream_embeddings). Its reference is the keep-all plan
# (every activation kept, every layer streamed, prefetch 1, no optimizer overlap) with the same data (gradient
# accumulation, dtype) and the same settings that change a summation order (stream_embeddings), trained on the
# synchronous engine in the dry run (FACTS: stream_embeddings changes the loss in the 7th digit, so it is compared
# against a reference with the same setting, and against the plain keep-all run within PLAN_SPACE_RTOL as well).
PLAN_SPACE_CASES = (
    "default",
    "resident",
    "optimizer_overlap",
    "grad_accum",
    "stream_embeddings",
    "block_recompute",
    "nvme",
    "bf16",
)
# Used only where bit-exactness cannot be asked for: when two runs of the reference itself differ on the device
# (non-deterministic kernels), and for stream_embeddings against the reference without it. Relative L2 of all
# final weights and relative error of every micro-batch loss; fp32 then bf16 (8 significant bits, several steps).
PLAN_SPACE_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
PLAN_SPACE_CHILD_TAG = "PLAN_SPACE_CHILD "
# the script whose --plan-space-child the sanitizer pass runs (beside this module)
GPU_CHECK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_check.py")


def plan_space_case(name: str, kinds: list[str], micro_batch: int, seq: int):
    """``(plan, gradient accumulation, dtype, description)`` of one case."""
    from lazytrain_hf.planner.plan import Plan

    L = len(kinds)
    plan = Plan.default(L, kinds, micro_batch_size=micro_batch, seq_len=seq, source="file")
    ga, dtype = 1, torch.float32
    if name == "default":
        desc = "Plan.default: all kept, streamed, prefetch 1, optimizer overlap on"
    elif name == "resident":
        plan.optimizer_overlap = False
        for lp in plan.layers[1:]:
            lp.resident = True
        desc = f"layers 1-{L - 1} resident, no overlap"
    elif name == "optimizer_overlap":
        plan.optimizer_overlap = True
        for lp in plan.layers:
            lp.resident = lp.index % 2 == 1
            lp.fetch_fwd_ahead = lp.fetch_bwd_ahead = 2
        plan.layers[0].policy = "offload_cpu"
        desc = "overlap on, odd layers resident, prefetch 2, layer 0 offload_cpu"
    elif name == "grad_accum":
        ga = 3
        plan.optimizer_overlap = False
        pols = [("offload_cpu", "gpu"), ("recompute", "cpu"), ("keep", "gpu"), ("recompute", "gpu")]
        for lp, (pol, tier) in zip(plan.layers, pols * L):
            lp.policy, lp.input_tier, lp.reload_ahead = pol, tier, 1
        desc = "gradient accumulation 3, offload_cpu / recompute(cpu) / keep / recompute"
    elif name == "stream_embeddings":
        plan.stream_embeddings = True
        desc = "embeddings, final norm and lm_head streamed"
    elif name == "block_recompute":
        plan.checkpoint_every = 2
        for lp in plan.layers:
            lp.policy, lp.input_tier = "recompute", "gpu"
        desc = "block recompute, checkpoint_every=2"
    elif name == "nvme":
        pols = [("offload_nvme", "gpu"), ("recompute", "nvme"), ("offload_cpu", "gpu"), ("offload_nvme", "gpu")]
        for lp, (pol, tier) in zip(plan.layers, pols * L):
            lp.policy, lp.input_tier, lp.reload_ahead = pol, tier, 2
        desc = "offload_nvme / recompute(nvme) / offload_cpu, spill dir in a temp dir"
    elif name == "bf16":
        dtype = torch.bfloat16
        plan.layers[1].policy = "offload_cpu"
        plan.layers[2].resident = True
        desc = "bf16 compute copy (fp32 masters), layer 1 offload_cpu, layer 2 resident, overlap on"
    else:
        raise ValueError(f"--plan-space-cases: unknown case {name!r}; choose from {', '.join(PLAN_SPACE_CASES)}.")
    return plan.validate(), ga, dtype, desc


def plan_space_reference_plan(kinds: list[str], micro_batch: int, seq: int, stream_embeddings: bool):
    from lazytrain_hf.planner.plan import Plan

    plan = Plan.default(L := len(kinds), kinds, micro_batch_size=micro_batch, seq_len=seq, source="file")
    assert plan.num_layers == L
    plan.optimizer_overlap = False
    plan.stream_embeddings = stream_embeddings
    return plan.validate()


def plan_space_sizes(dry_run: bool) -> dict[str, int]:
    if dry_run:
        return dict(hidden=32, layers=4, vocab=128, seq=16, micro_batch=2, steps=3)
    return dict(hidden=256, layers=4, vocab=2048, seq=256, micro_batch=4, steps=6)


def plan_space_train(cfg, plan, ga: int, dtype: torch.dtype, device: torch.device, steps: int, simulate: bool,
                     tmp: str, extra_args: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Train ``steps`` optimizer steps through `LazyTrainer(planner_plan=...)`; losses, weights, masters, timing.
    ``extra_args``: more `LazyTrainingArguments` fields (``state_nvme_dir``: the literal "<nvme>" is the run's
    spill directory)."""
    from datasets import Dataset
    from transformers import TrainerCallback

    from lazytrain_hf import LazyTrainer, LazyTrainingArguments
    from lazytrain_hf.streams import SIMULATE_ENV

    prev = os.environ.get(SIMULATE_ENV)
    os.environ[SIMULATE_ENV] = "1" if simulate else "0"
    try:
        run_dir = tempfile.mkdtemp(dir=tmp)
        nvme = os.path.join(run_dir, "nvme")
        os.makedirs(nvme)
        plan_path = os.path.join(run_dir, "plan.json")
        plan.to_json(plan_path)
        model = build_model(cfg, torch.float32, torch.device("cpu")).to(dtype)
        n = steps * ga * plan.micro_batch_size
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(0, cfg.vocab_size, (n, plan.seq_len), generator=g)
        ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
        args = LazyTrainingArguments(
            output_dir=os.path.join(run_dir, "out"),
            per_device_train_batch_size=plan.micro_batch_size,
            gradient_accumulation_steps=ga,
            max_steps=steps,
            learning_rate=1e-2,
            max_grad_norm=1.0,
            logging_steps=steps,  # one log at the end: no per-step loss read-back
            report_to=[],
            seed=5,
            data_seed=5,
            use_cpu=device.type == "cpu",
            save_strategy="no",
            disable_tqdm=True,
            planner_plan=plan_path,
            activation_nvme_dir=nvme,
            **{k: nvme if v == "<nvme>" else v for k, v in (extra_args or {}).items()},
        )
        trainer = LazyTrainer(model=model, args=args, train_dataset=ds)
        losses: list[torch.Tensor] = []
        inner = trainer.compute_loss

        def compute_loss(*a, **k):
            loss = inner(*a, **k)
            losses.append(loss.detach().clone())
            return loss

        trainer.compute_loss = compute_loss
        got: dict[str, Any] = {"step_ends": [], "masters": {}, "host_syncs": None, "peak": None}

        class Capture(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                got["step_ends"].append(time.perf_counter())

            def on_train_end(self, args, state, control, **kwargs):
                trainer._updater.wait_all()
                # master_values: units whose state is on NVMe have placeholders in named_masters
                got["masters"] = {k: m.detach().clone().cpu() for k, m in trainer._updater.master_values().items()}
                handle = getattr(trainer, "stream_handle", None)
                if handle is not None and device.type == "cpu":
                    got["peak"] = int(handle.memory_stats()["device_peak_bytes"])
                trace = getattr(handle, "trace", None)
                per_step = getattr(trace, "steps", None)
                if per_step is not None:
                    got["host_syncs"] = [int(s.get("host_syncs", 0)) for s in per_step]

        trainer.add_callback(Capture())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        trainer.train()
        sync(device)
        wall = time.perf_counter() - t0
        if device.type == "cuda":
            got["peak"] = int(torch.cuda.max_memory_allocated(device))
        ends = got["step_ends"]
        durations = [b - a for a, b in zip(ends, ends[1:])]  # steps 2..N (the first includes the warm-up)
        weights = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
        trainer = model = None  # noqa: F841 (dropped before the next run builds its own)
        free_device_memory(device)
        return {
            "losses": [x.float().cpu() for x in losses],
            "weights": weights,
            "masters": got["masters"],
            "step_time_s": statistics.median(durations) if durations else None,
            "train_wall_s": wall,
            "peak_device_bytes": got["peak"],
            "host_syncs_per_step": got["host_syncs"],
        }
    finally:
        if prev is None:
            os.environ.pop(SIMULATE_ENV, None)
        else:
            os.environ[SIMULATE_ENV] = prev


def _state_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[bool, float, list[str]]:
    """(bit-exact, relative L2 of all tensors together, names that differ)."""
    bad = [k for k in ref if k not in got or not torch.equal(got[k], ref[k])]
    num = sum(float((got[k].double() - ref[k].double()).square().sum()) for k in ref if k in got)
    den = sum(float(ref[k].double().square().sum()) for k in ref)
    return not bad and sorted(got) == sorted(ref), math.sqrt(num / max(den, 1e-30)), bad


def compare_runs(got: dict, ref: dict) -> dict[str, Any]:
    """Losses, final weights and fp32 masters of ``got`` against ``ref``: bit-exact, and the relative errors."""
    n = min(len(got["losses"]), len(ref["losses"]))
    loss_exact = len(got["losses"]) == len(ref["losses"]) and all(
        torch.equal(a, b) for a, b in zip(got["losses"], ref["losses"])
    )
    loss_err = max(
        (float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12) for a, b in zip(got["losses"], ref["losses"])),
        default=0.0,
    )
    w_exact, w_err, w_bad = _state_diff(got["weights"], ref["weights"])
    m_exact, m_err, m_bad = _state_diff(got["masters"], ref["masters"])
    return {
        "bit_exact": bool(loss_exact and w_exact and m_exact),
        "losses_compared": n,
        "loss_count_match": len(got["losses"]) == len(ref["losses"]),
        "max_loss_rel_err": loss_err,
        "weights_rel_l2": w_err,
        "masters_rel_l2": m_err,
        "first_differing": (w_bad + m_bad)[:5],
    }


def median_or_na(xs: list[int] | None) -> str:
    return "n/a" if xs is None or not xs else f"{statistics.median(xs):g}"


def plan_space_cases_run(device: torch.device, dry_run: bool, names: list[str], steps: int | None = None,
                         with_references: bool = True) -> dict[str, Any]:  # fmt: skip
    """Run every case (and, with ``with_references``, its reference); returns per-case rows (no tensors)."""
    from lazytrain_hf import models

    sz = plan_space_sizes(dry_run)
    steps = steps or sz["steps"]
    cfg = tiny_hf_config("qwen3", hidden=sz["hidden"], layers=sz["layers"], vocab=sz["vocab"])
    kinds = models.layer_kinds(cfg)
    simulate = device.type == "cpu"  # cases under the simulated asynchronous engine; references synchronous
    out: dict[str, Any] = {"sizes": dict(sz, steps=steps), "cases": {}, "references": {}}
    refs: dict[tuple, dict] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_plan_space_") as tmp:

        def reference(ga: int, dtype: torch.dtype, se: bool) -> dict:
            key = (ga, dtype, se)
            if key not in refs:
                plan = plan_space_reference_plan(kinds, sz["micro_batch"], sz["seq"], se)
                refs[key] = plan_space_train(cfg, plan, ga, dtype, device, steps, False, tmp)
                out["references"][f"ga={ga} {str(dtype).split('.')[-1]} stream_embeddings={se}"] = {
                    "step_time_s": refs[key]["step_time_s"],
                    "peak_device_bytes": refs[key]["peak_device_bytes"],
                }
            return refs[key]

        deterministic = None
        if with_references:
            base = reference(1, torch.float32, False)
            again = plan_space_train(
                cfg, plan_space_reference_plan(kinds, sz["micro_batch"], sz["seq"], False), 1, torch.float32, device,
                steps, False, tmp,
            )  # fmt: skip
            deterministic = compare_runs(again, base)["bit_exact"]
            out["reference_deterministic"] = deterministic
        for name in names:
            plan, ga, dtype, desc = plan_space_case(name, kinds, sz["micro_batch"], sz["seq"])
            row: dict[str, Any] = {"case": name, "plan": desc, "gradient_accumulation": ga,
                                   "dtype": str(dtype).split(".")[-1]}  # fmt: skip
            try:
                run = plan_space_train(cfg, plan, ga, dtype, device, steps, simulate, tmp)
            except Exception as e:  # a failing case is a result; the others still run
                row.update(
                    status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(), ok=False
                )
                out["cases"][name] = row
                continue
            row.update(
                status="ok",
                step_time_s=run["step_time_s"],
                peak_device_bytes=run["peak_device_bytes"],
                host_syncs_per_step=run["host_syncs_per_step"],
            )
            if with_references:
                ref = reference(ga, dtype, plan.stream_embeddings)
                cmp = compare_runs(run, ref)
                tol = PLAN_SPACE_RTOL[dtype]
                within = cmp["max_loss_rel_err"] <= tol and cmp["weights_rel_l2"] <= tol and cmp["loss_count_match"]
                row["vs_reference"] = cmp
                row["check"] = "bit-exact" if deterministic else f"rel err <= {tol:g} (reference not deterministic)"
                row["ok"] = bool(cmp["bit_exact"] if deterministic else within)
                if plan.stream_embeddings:
                    plain = compare_runs(run, reference(ga, dtype, False))
                    row["vs_keep_all_without_stream_embeddings"] = plain
                    row["ok"] = row["ok"] and plain["max_loss_rel_err"] <= tol and plain["weights_rel_l2"] <= tol
            out["cases"][name] = row
    return out


def _sanitizer_pass(device: torch.device, dry_run: bool, names: list[str], timeout_s: float) -> dict[str, Any]:
    """Every case once more (2 steps, no references) in a child process of this script under PyTorch's CUDA stream
    sanitizer (``TORCH_CUDA_SANITIZER=1``); what it reports about unsynchronised accesses, per case. The sanitizer
    needs CUDA (with a CPU-only torch every operator fails under it): on the CPU the child runs without it and the
    result says so."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    enabled = device.type == "cuda"
    if enabled:
        env["TORCH_CUDA_SANITIZER"] = "1"
    else:
        env.pop("TORCH_CUDA_SANITIZER", None)
    cmd = [sys.executable, GPU_CHECK_SCRIPT, "--plan-space-child", "--plan-space-cases", ",".join(names),
           "--out", tempfile.gettempdir()] + (["--dry-run"] if dry_run else [])  # fmt: skip
    t0 = time.perf_counter()
    res: dict[str, Any] = {"enabled": enabled, "command": " ".join(cmd), "cases": {}}
    if not enabled:
        res["note"] = "TORCH_CUDA_SANITIZER needs CUDA: the child ran the cases without the sanitizer"
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(10.0, timeout_s))
    except subprocess.TimeoutExpired as e:
        res.update(status="timeout", seconds=time.perf_counter() - t0, stderr_tail=str(e.stderr or "")[-2000:])
        return res
    res["seconds"] = time.perf_counter() - t0
    res["returncode"] = proc.returncode
    races = [b.strip() for b in proc.stderr.split("============================") if "CSAN detected" in b]
    res["unsynchronized_accesses"] = races[:20]
    res["num_unsynchronized_accesses"] = len(races)
    line = [x for x in proc.stdout.splitlines() if x.startswith(PLAN_SPACE_CHILD_TAG)]
    if not line:
        res.update(status="error", stderr_tail=proc.stderr[-3000:])
        return res
    child = json.loads(line[-1][len(PLAN_SPACE_CHILD_TAG) :])
    for name, row in child["cases"].items():
        err = row.get("error", "")
        res["cases"][name] = {
            "status": row["status"],
            "error": err[:2000],
            "race": "CSAN detected" in err or "CUDASanitizerErrors" in err,
        }
    res["status"] = "ok" if proc.returncode == 0 else "error"
    return res


def section_plan_space(device: torch.device, dry_run: bool, names: list[str], sanitizer: bool,
                       budget: Budget) -> dict[str, Any]:  # fmt: skip
    """Parity and timing over the plan space (See PLAN_SPACE_CASES), then one pass under the CUDA stream
    sanitizer. One row per case."""
    det = None
    if device.type == "cuda":
        det = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)  # bit-exactness needs deterministic kernels
    try:
        out = plan_space_cases_run(device, dry_run, names)
    finally:
        if det is not None:
            torch.use_deterministic_algorithms(det)
    tol = ", ".join(f"{str(k).split('.')[-1]} {v:g}" for k, v in PLAN_SPACE_RTOL.items())
    out["tolerance"] = (
        "losses (every micro-batch), final weights and fp32 masters torch.equal to the keep-all, no-overlap run with "
        "the same gradient accumulation, dtype and stream_embeddings"
        + (" (synchronous engine; cases on the simulated asynchronous engine)" if device.type == "cpu" else "")
        + f"; when two reference runs differ on the device, and for stream_embeddings against the reference without "
        f"it: max relative loss error and relative L2 of the weights <= {tol}"
    )
    if sanitizer:
        left = max(60.0, budget.seconds - budget.elapsed()) if device.type == "cuda" else 300.0
        out["sanitizer"] = _sanitizer_pass(device, dry_run, names, timeout_s=min(240.0, left))
    else:
        out["sanitizer"] = {"enabled": False, "status": "skipped", "cases": {}}
    san = out["sanitizer"]
    log(f"   reference (keep-all, no overlap) deterministic on {device}: {out.get('reference_deterministic')}")
    log(f"   {'case':<18} {'ok':<5} {'check':<10} {'step ms':>9} {'peak MiB':>9} {'syncs/step':>10}  sanitizer  plan")
    for name in names:
        row = out["cases"][name]
        if row["status"] != "ok":
            log(f"   {name:<18} FAIL  error: {row['error'][:150]}")
            continue
        srow = san.get("cases", {}).get(name)
        if not san.get("enabled"):
            s = "n/a (cpu)" if srow is None or srow["status"] == "ok" else "child err"
        else:
            s = "race" if srow and srow["race"] else ("clean" if srow and srow["status"] == "ok" else "error")
        row["sanitizer"] = s
        peak = row["peak_device_bytes"]
        log(
            f"   {name:<18} {str(row['ok']):<5} {'exact' if row['vs_reference']['bit_exact'] else 'tol':<10} "
            f"{1e3 * (row['step_time_s'] or 0):>9.2f} {(peak or 0) / 2**20:>9.2f} "
            f"{median_or_na(row['host_syncs_per_step']):>10}  {s:<10} {row['plan']}"
        )
    if san.get("enabled"):
        log(f"   sanitizer: {san.get('num_unsynchronized_accesses', 0)} unsynchronised accesses reported")
        for r in san.get("unsynchronized_accesses", [])[:3]:
            log("   " + r.replace("\n", "\n   ")[:1500])
    elif san.get("note"):
        log(f"   sanitizer: {san['note']}")
    out["ok"] = all(out["cases"][n].get("ok") for n in names) and (
        san.get("status") in ("ok", "skipped") and not san.get("num_unsynchronized_accesses")
    )
    return out


def plan_space_child(args) -> int:
    """``--plan-space-child``: the cases once (2 steps, no references); one JSON line (the parent reads it)."""
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    names = args.plan_space_cases
    res = plan_space_cases_run(device, args.dry_run, names, steps=2, with_references=False)
    rows = {n: {k: v for k, v in r.items() if k in ("status", "error")} for n, r in res["cases"].items()}
    print(PLAN_SPACE_CHILD_TAG + json.dumps({"cases": rows}), flush=True)
    return 0


def plan_space_line(report: dict) -> str:
    sec = report["sections"].get("plan_space", {})
    if sec.get("status") != "ok":
        return f"plan space: {sec.get('status', 'skipped')}"
    res = sec["result"]
    cases = res["cases"]
    san = res["sanitizer"]
    san_text = (
        f"sanitizer {san.get('num_unsynchronized_accesses', 0)} unsynchronised accesses"
        if san.get("enabled")
        else f"sanitizer {san.get('status')}: {san.get('note', 'not run')}"
    )
    return (
        f"plan space: {'ok' if res['ok'] else 'FAILED'} ({sum(bool(c.get('ok')) for c in cases.values())}/"
        f"{len(cases)} cases match the keep-all no-overlap reference; {san_text})"
    )
