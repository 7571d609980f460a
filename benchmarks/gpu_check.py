"""End-to-end check and measurement of the GPU path: parity, hardware profile, step time per plan, predictions.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py --out $OUT/gpu --budgets 24GiB,48GiB     # one GPU
    PYTHONPATH=. python benchmarks/gpu_check.py --only-plan-space --out $OUT/ps                 # plan space only
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_check.py --dry-run --out /tmp/gc               # CPU, tiny sizes

Sections, run in order; each is guarded (a failure is recorded in the JSON with its traceback and the script goes
on):

1. ``environment``: torch / transformers versions, device, host memory.
2. ``parity``: tiny qwen3 and qwen3_moe in bf16 on the device, streamed vs plain loss and gradients for each
   activation policy vector (all keep, all offload_cpu, all recompute, and a mixed vector with an NVMe spill under a
   temp dir). Two checks: bit-exact against the plain bf16 model (the executor only moves data; HF loss path), and
   relative L2 error against a plain fp32 model (the bf16 rounding), tolerance `PARITY_RTOL`. The chunked loss
   (`StreamHandle.causal_lm_loss`, what training uses) is compared within the same tolerance. A second plain bf16
   run tells whether the device kernels themselves are deterministic.
3. ``profile``: `hardware.measure(device=...)` (pinned H2D/D2H bandwidth, matmul rate, NVMe, CPU optimizer rate)
   -> ``measured_profile.json``. After the model sections its ``achievable_fraction`` is calibrated from the measured
   per-layer forward/backward times (decoder-layer FLOP rate / matmul rate), and one profile per model
   (``measured_profile_<model>.json``, with that model's per-kind layer times) is written beside it. Either file can
   be fed to ``lazytrain plan --hardware path.json``.
   ``optimizer``: the host CPU's optimizer step, HybridAdamW8bit (native kernel; numba where it cannot be built)
   vs torch fused AdamW + ``clip_grad_norm_`` on 200M parameters (the cases of ``bench_optim.py``), on all of the
   machine's cores.
4. ``model:<name>`` for each model size (Qwen2.5-1.5B/3B/7B configs, random init, bf16, seq 1024): per-layer
   forward/backward times from timed passes through the streamed model (as `LazyTrainer.measure_layer_times`), then
   for each GPU budget the MILP plan (largest feasible micro-batch), ``megatrain`` and ``keep_all`` (when it fits)
   at the largest batch each allows, each trained for a few real steps: streamed forward and chunked loss, backward,
   global norm, clip coefficient, `LayerwiseUpdater` with `HybridAdamW8bit` (per-layer update + ``sync_compute``),
   ``zero_grad``. Median step time, TFLOPS, peak device memory.
5. ``prediction``: the stage model's (MILP) and the simulator's step time against the measured one, error in %.

``plan_space`` (after ``optimizer``, before the model sections): parity and timing over the plan space on a small
qwen3 (4 layers; hidden 256, seq 256, micro-batch 4, 6 steps on the GPU), trained through
``LazyTrainer(planner_plan=...)``. Cases (`PLAN_SPACE_CASES`): ``default`` (Plan.default), ``resident`` (layers
resident), ``optimizer_overlap``, ``grad_accum`` (3 micro-batches), ``stream_embeddings``, ``block_recompute``
(``checkpoint_every=2``), ``nvme`` (spill dir in a temp dir), ``bf16`` (bf16 compute copy, fp32 masters). Each is
compared with the keep-all, no-overlap run with the same gradient accumulation, dtype and stream_embeddings: every
micro-batch loss, final weight and fp32 master ``torch.equal`` (the executor only moves data) when two runs of that
reference agree bit for bit on the device (deterministic algorithms on, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``),
otherwise within `PLAN_SPACE_RTOL`; ``stream_embeddings`` is also held to `PLAN_SPACE_RTOL` against the reference
without it (its summation order differs). Per case: median step time (steps 2..N), peak device memory, host syncs
per step (``handle.trace.steps``; "n/a" without a trace). Then every case once more (2 steps) in a child process of
this script under PyTorch's CUDA stream sanitizer (``TORCH_CUDA_SANITIZER=1``; it sees the kernels launched on the
training and autograd threads), reporting every unsynchronised access it prints. One row per case.

Time on one H200 (estimate; not measured yet): imports and environment ~15 s, parity ~20 s, profile ~30 s,
optimizer ~30 s, plan space ~40 s + sanitizer pass ~60-120 s, then the model sections until the time budget
(default 400 s from the start) is spent, plus the last run's overrun and the writes: ~7-7.5 minutes in all.

The time budget (``--time-budget-s``) skips the remaining runs and model sizes, with a note, once it would be
exceeded. Outputs in ``--out``: ``gpu_check.json``, ``gpu_check.md``, ``measured_profile.json`` (+ per model); the
short table is printed last.

``--dry-run`` runs the same code on the CPU with tiny qwen3 / qwen3_moe configs and tiny budgets that force
streaming; there the "GPU" is the CPU (peak memory is the executor's accounted device peak, not an allocator's).
Plan-space cases run on the simulated asynchronous CPU engine (``LAZYTRAIN_SIMULATE_ASYNC=1``), their references on
the synchronous one; the sanitizer needs CUDA, so there the child runs the cases without it and says so.
``--only-plan-space`` runs just that section (``--plan-space-cases a,b`` a subset, ``--no-sanitizer`` without the
child).

This file holds the command line (`make_parser`, `main`, `finish`), the environment, parity, profile and optimizer
sections, and the report (``gpu_check.json``, ``gpu_check.md``, the summary table). Beside it, each imported by the
ones above it and never the other way: ``gpu_check_cuda.py`` (the ``cuda_semantics`` section),
``gpu_check_models.py`` (the model and prediction sections), ``gpu_check_plan_space.py`` (the plan-space section and
its sanitizer child) and ``gpu_check_common.py`` (the log, constants, tiny configs, models, batches, `Budget`,
`run_section`). The names that moved there are still importable from this file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from gpu_check_common import (
    PARITY_ATOL,
    PARITY_RTOL,
    SEED,
    Budget,
    GiB,
    build_model,
    free_device_memory,
    log,
    make_batch,
    model_configs,
    run_section,
    tiny_hf_config,
)
from gpu_check_common import count_params as count_params
from gpu_check_common import sync as sync
from gpu_check_models import calibrated_profile as calibrated_profile
from gpu_check_models import measure_layer_times as measure_layer_times
from gpu_check_models import section_model, section_prediction
from gpu_check_models import train_steps as train_steps
from gpu_check_plan_space import (
    PLAN_SPACE_CASES,
    median_or_na,
    plan_space_child,
    plan_space_line,
    section_plan_space,
)
from gpu_check_plan_space import PLAN_SPACE_CHILD_TAG as PLAN_SPACE_CHILD_TAG
from gpu_check_plan_space import PLAN_SPACE_RTOL as PLAN_SPACE_RTOL
from gpu_check_plan_space import compare_runs as compare_runs
from gpu_check_plan_space import plan_space_case as plan_space_case
from gpu_check_plan_space import plan_space_cases_run as plan_space_cases_run
from gpu_check_plan_space import plan_space_reference_plan as plan_space_reference_plan
from gpu_check_plan_space import plan_space_sizes as plan_space_sizes
from gpu_check_plan_space import plan_space_train as plan_space_train

# ``name as name`` above: a name that moved out of this file (to gpu_check_common, gpu_check_models or
# gpu_check_plan_space) and is still importable from it, e.g. ``from gpu_check import count_params``.


# ---------------------------------------------------------------------------------------------------- section 1
def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def section_environment(device: torch.device) -> dict[str, Any]:
    import psutil
    import transformers

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({_cpu_name()})",
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "host_memory_bytes": int(psutil.virtual_memory().total),
        "host_available_bytes": int(psutil.virtual_memory().available),
    }
    if device.type == "cuda":
        out["device_memory_bytes"] = int(torch.cuda.get_device_properties(device).total_memory)
        out["cuda"] = torch.version.cuda
    log("   " + ", ".join(f"{k}={v}" for k, v in out.items()))
    return out


# ---------------------------------------------------------------------------------------------------- section 2
def _rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().float().cpu(), ref.detach().float().cpu()
    denom = float(torch.linalg.vector_norm(ref))
    diff = float(torch.linalg.vector_norm(a - ref))
    return diff if denom < PARITY_ATOL else diff / denom


def _rel_l2_all(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Relative L2 error of all gradients together (every tensor of ``ref`` present in ``got``)."""
    diff = sum(float(torch.linalg.vector_norm(got[n] - ref[n]).square()) for n in ref if n in got)
    norm = sum(float(torch.linalg.vector_norm(ref[n]).square()) for n in ref)
    return math.sqrt(diff / max(norm, 1e-30))


def _plain_run(config: Any, dtype: torch.dtype, device: torch.device, batch: dict) -> tuple[float, dict]:
    model = build_model(config, dtype, device).to(device)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    out = float(loss.detach().float()), grads
    del model
    free_device_memory(device)
    return out


def section_parity(device: torch.device, dry_run: bool) -> dict[str, Any]:
    from lazytrain_hf import models
    from lazytrain_hf.planner.plan import Plan
    from lazytrain_hf.streaming import attach

    vectors = {
        "all_keep": [("keep", "gpu")] * 4,
        "all_offload_cpu": [("offload_cpu", "gpu")] * 4,
        "all_recompute": [("recompute", "gpu")] * 4,
        "mixed_nvme": [("keep", "gpu"), ("offload_cpu", "gpu"), ("offload_nvme", "gpu"), ("recompute", "cpu")],
    }
    seq = 32 if dry_run else 256
    out: dict[str, Any] = {
        "dtype": "bfloat16",
        "tolerance": (
            f"bit-exact (torch.equal) vs the plain bf16 model on the HF loss path when two plain bf16 runs agree "
            f"bit for bit; relative L2 error of all gradients <= {PARITY_RTOL} vs a plain fp32 model; chunked loss "
            f"(fp32 sums in another order) within {PARITY_RTOL} of the plain bf16 loss and gradients"
        ),
        "models": {},
    }
    all_ok = True
    for model_type in ("qwen3", "qwen3_moe"):
        cfg = tiny_hf_config(model_type)
        batch = make_batch(cfg.vocab_size, 2, seq, device)
        ref_loss, ref_g = _plain_run(cfg, torch.bfloat16, device, batch)
        rep_loss, rep_g = _plain_run(cfg, torch.bfloat16, device, batch)
        deterministic = ref_loss == rep_loss and all(torch.equal(ref_g[n], rep_g[n]) for n in ref_g)
        f32_loss, f32_g = _plain_run(cfg, torch.float32, device, batch)
        bf16_vs_f32 = _rel_l2_all(ref_g, f32_g)
        per: dict[str, Any] = {
            "plain_bf16_deterministic": deterministic,
            "plain_bf16_vs_fp32_rel_l2": bf16_vs_f32,
            "plain_loss_bf16": ref_loss,
            "plain_loss_fp32": f32_loss,
            "vectors": {},
        }
        for vname, pols in vectors.items():
            with tempfile.TemporaryDirectory(prefix="gpu_check_nvme_") as nvme:
                model = build_model(cfg, torch.bfloat16, device)
                kinds = models.layer_kinds(model)
                plan = Plan.default(len(kinds), kinds=kinds, prefetch_depth=1)
                plan.loss_chunk_tokens = seq  # several chunks per batch
                for lp, (pol, tier) in zip(plan.layers, pols):
                    lp.policy, lp.input_tier = pol, tier
                handle = attach(model, plan=plan, device=device, nvme_dir=nvme)
                row: dict[str, Any] = {}
                try:
                    for path in ("hf_loss", "chunked_loss"):
                        loss = model(**batch).loss if path == "hf_loss" else handle.causal_lm_loss(model, batch)
                        loss.backward()
                        got = {n: g.detach().float().cpu() for n, g in handle.grads().items()}
                        handle.zero_grad()
                        lval = float(loss.detach().float())
                        missing = sorted(set(ref_g) - set(got))
                        exact = lval == ref_loss and not missing and all(torch.equal(got[n], ref_g[n]) for n in ref_g)
                        row[path] = {
                            "loss": lval,
                            "bit_exact_vs_plain_bf16": exact,
                            "rel_l2_vs_plain_bf16": _rel_l2_all(got, ref_g),
                            "rel_l2_vs_fp32": _rel_l2_all(got, f32_g),
                            "max_tensor_rel_l2_vs_fp32": max(_rel_l2(got[n], f32_g[n]) for n in f32_g if n in got),
                            "loss_rel_err_vs_plain_bf16": abs(lval - ref_loss) / max(abs(ref_loss), 1e-12),
                            "missing_grads": missing,
                        }
                finally:
                    handle.remove()
                    del model
                    free_device_memory(device)
                hf, ch = row["hf_loss"], row["chunked_loss"]
                row["ok"] = bool(
                    not hf["missing_grads"]
                    and not ch["missing_grads"]
                    and hf["rel_l2_vs_fp32"] <= PARITY_RTOL
                    and ch["rel_l2_vs_plain_bf16"] <= PARITY_RTOL
                    and ch["loss_rel_err_vs_plain_bf16"] <= PARITY_RTOL
                    and (hf["bit_exact_vs_plain_bf16"] or not deterministic)
                )
                all_ok &= row["ok"]
                per["vectors"][vname] = row
                log(
                    f"   {model_type:<10} {vname:<16} bit-exact {str(hf['bit_exact_vs_plain_bf16']):<5} "
                    f"rel L2 vs fp32 {hf['rel_l2_vs_fp32']:.2e} (worst tensor {hf['max_tensor_rel_l2_vs_fp32']:.2e})"
                    f"  chunked vs bf16 {ch['rel_l2_vs_plain_bf16']:.2e}  {'ok' if row['ok'] else 'FAIL'}"
                )
        out["models"][model_type] = per
    out["ok"] = all_ok
    return out


# ---------------------------------------------------------------------------------------------------- optimizer
def section_optimizer(dry_run: bool, params: int) -> dict[str, Any]:
    """Host-CPU optimizer step on this machine's cores: HybridAdamW8bit (native kernel, else numba; norm from the
    device, or a host norm pass) vs torch fused AdamW + clip_grad_norm_, the cases and table of bench_optim.py."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_optim

    from lazytrain_hf.optim import native

    reps = 3 if dry_run else 5
    backend = "native" if native.available() else "numba"  # no C compiler on the machine: the numba kernel
    bw = bench_optim.stream_bandwidth(reps, elems=(1 << 22) if dry_run else (1 << 28))
    rate = bench_optim.native_compute_rate(reps)
    rows = bench_optim.measure(params, bench_optim.make_cases(reps, [backend], foreach=False), bw["in_place"])
    threads = torch.get_num_threads()
    log(f"   {params / 1e6:.0f}M parameters, {threads} threads, in-place bandwidth {bw['in_place']:.1f} GB/s")
    if rate is not None:
        log(f"   native kernel compute, 1 thread, in cache: {rate:.2f} ns/param ({rate / threads:.3f} at {threads})")
    log("   " + bench_optim.format_rows(rows).replace("\n", "\n   "))
    return {
        "params": params,
        "backend": backend,
        "threads": threads,
        "bandwidth_gb_s": bw,
        "native_compute_ns_per_param_1_thread": rate,
        "rows": rows,
    }


def optimizer_line(report: dict) -> str:
    sec = report["sections"].get("optimizer", {})
    if sec.get("status") != "ok":
        return f"optimizer: {sec.get('status', 'skipped')}"
    res = sec["result"]
    ratios = {r["optimizer"].split("] ")[-1]: r["x_torch_fused"] for r in res["rows"] if not r.get("skipped")}
    dev = ratios.get("device norm (step only)")
    host = ratios.get("host norm + fused clip")

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    return (
        f"optimizer (host CPU, {res['threads']} threads, {res['params'] / 1e6:.0f}M params): HybridAdamW8bit "
        f"{fmt(dev)} (norm from the device) / {fmt(host)} (host norm) the speed of torch fused AdamW + clip_grad_norm_"
    )


# ---------------------------------------------------------------------------------------------------- section 3
def section_profile(device: torch.device, dry_run: bool, out_dir: str) -> dict[str, Any]:
    from lazytrain_hf.planner import hardware

    with tempfile.TemporaryDirectory(prefix="gpu_check_probe_") as nvme:
        kw = (
            dict(copy_bytes=32 << 20, nvme_bytes=16 << 20, optimizer_params=1_000_000, matmul_size=512, repeats=3)
            if dry_run
            else dict(
                copy_bytes=1 << 30, nvme_bytes=512 << 20, optimizer_params=50_000_000, matmul_size=8192, repeats=5
            )
        )
        prof = hardware.measure(device=str(device), nvme_dir=nvme, use_cache=False, **kw)
    path = os.path.join(out_dir, "measured_profile.json")
    prof.to_json(path)
    log("   " + prof.summary())
    return {"profile": prof.to_dict(), "path": path, "measure_args": kw}


# ---------------------------------------------------------------------------------------------------- tables
def summary_rows(model_results: list[dict]) -> list[dict[str, Any]]:
    rows = []
    for res in model_results:
        mega = {r["budget"]: r.get("tflops") for r in res.get("runs", []) if r["plan"] == "megatrain"}
        for r in res.get("runs", []):
            row = {"model": res["model"], "budget": r["budget"], "plan": r["plan"], "status": r.get("status")}
            if r.get("status") == "ok":
                base = mega.get(r["budget"])
                row.update(
                    batch=r["batch"],
                    step_s=r["step_time_s"],
                    tokens_per_s=r["tokens_per_s"],
                    tflops=r["tflops"],
                    vs_megatrain=(r["tflops"] / base) if base else None,
                    peak_gib=r["peak_device_bytes"] / GiB,
                    reserved_gib=None if r.get("peak_reserved_bytes") is None else r["peak_reserved_bytes"] / GiB,
                    within_budget=r["within_budget"] and r.get("reserved_within_budget") is not False,
                    milp_err_pct=r["milp_err_pct"],
                    sim_err_pct=r["sim_err_pct"],
                )
            else:
                row["note"] = r.get("note") or r.get("error", "")
            rows.append(row)
        for n in res.get("notes", []):
            rows.append({"model": res["model"], "budget": "-", "plan": "-", "status": "skipped", "note": n})
    return rows


COLS = ("model", "budget", "plan", "B", "step s", "tok/s", "TFLOPS", "vs mega", "peak GiB", "rsv GiB", "in bdgt",
        "pred%", "sim%")  # fmt: skip


def _cells(r: dict) -> list[str]:
    if r.get("status") != "ok":
        return [r["model"], r["budget"], r["plan"], f"{r.get('status')}: {r.get('note', '')}"[:90]]
    vs = f"{r['vs_megatrain']:.2f}x" if r.get("vs_megatrain") else "-"
    return [
        r["model"], r["budget"], r["plan"], str(r["batch"]), f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.0f}",
        f"{r['tflops']:.3f}", vs, f"{r['peak_gib']:.3f}",
        "-" if r.get("reserved_gib") is None else f"{r['reserved_gib']:.3f}", "yes" if r["within_budget"] else "NO",
        f"{r['milp_err_pct']:+.1f}", f"{r['sim_err_pct']:+.1f}",
    ]  # fmt: skip


def text_table(rows: list[dict]) -> str:
    widths = (16, 7, 10, 4, 8, 9, 8, 8, 9, 7, 7, 7)
    lines = [" ".join(f"{c:<{w}}" if i < 3 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(COLS, widths)))]
    for r in rows:
        cells = _cells(r)
        if len(cells) < len(COLS):
            lines.append(" ".join(f"{c:<{w}}" for c, w in zip(cells[:3], widths)) + " " + cells[3])
        else:
            lines.append(
                " ".join(f"{c:<{w}}" if i < 3 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths)))
            )
    return "\n".join(lines)


def markdown(report: dict, rows: list[dict], header: list[str]) -> str:
    out = ["# gpu_check", "", *[f"- {h}" for h in header], ""]
    out += ["| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    for r in rows:
        cells = _cells(r)
        cells += [""] * (len(COLS) - len(cells))
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    par = report["sections"].get("parity", {})
    if par.get("status") == "ok":
        p = par["result"]
        out += ["## Parity (bf16)", "", f"Tolerance: {p['tolerance']}.", ""]
        out += [
            "| model | policies | bit-exact vs plain bf16 | rel L2 vs fp32 (worst tensor) | chunked vs bf16 | ok |",
            "|---|---|---|---|---|---|",
        ]
        for mt, per in p["models"].items():
            for vn, row in per["vectors"].items():
                hf, ch = row["hf_loss"], row["chunked_loss"]
                out.append(
                    f"| {mt} | {vn} | {hf['bit_exact_vs_plain_bf16']} | {hf['rel_l2_vs_fp32']:.2e} "
                    f"({hf['max_tensor_rel_l2_vs_fp32']:.2e}) | {ch['rel_l2_vs_plain_bf16']:.2e} | {row['ok']} |"
                )
            out.append(
                f"| {mt} | plain bf16 twice | deterministic: {per['plain_bf16_deterministic']} | "
                f"{per['plain_bf16_vs_fp32_rel_l2']:.2e} | | |"
            )
        out.append("")
    ps = report["sections"].get("plan_space", {})
    if ps.get("status") == "ok":
        p = ps["result"]
        out += ["## Plan space", "", f"Check: {p['tolerance']}.", ""]
        out += [f"Reference deterministic on the device: {p.get('reference_deterministic')}.", ""]
        out += [
            "| case | plan | ok | bit-exact | max loss rel err | weights rel L2 | step ms | peak MiB | host syncs/step "
            "| sanitizer |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, row in p["cases"].items():
            if row["status"] != "ok":
                out.append(f"| {name} | {row['plan']} | False | error: {row['error'][:200]} | | | | | | |")
                continue
            cmp = row["vs_reference"]
            out.append(
                f"| {name} | {row['plan']} | {row['ok']} | {cmp['bit_exact']} | {cmp['max_loss_rel_err']:.2e} | "
                f"{cmp['weights_rel_l2']:.2e} | {1e3 * (row['step_time_s'] or 0):.2f} | "
                f"{(row['peak_device_bytes'] or 0) / 2**20:.2f} | {median_or_na(row['host_syncs_per_step'])} | "
                f"{row.get('sanitizer', '-')} |"
            )
        san = p["sanitizer"]
        out += ["", f"Sanitizer: {san.get('status')}, enabled {san.get('enabled')}; {san.get('note', '')}"]
        for r in san.get("unsynchronized_accesses", []):
            out += ["", "```", r, "```"]
        out.append("")
    for name, sec in report["sections"].items():
        if sec["status"] != "ok":
            out += [f"## Section `{name}` failed", "", "```", sec.get("traceback", sec.get("error", "")), "```", ""]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------- main
def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--out", required=True, help="output directory (gpu_check.json, gpu_check.md, measured_profile.json)"
    )
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny configs and budgets (the same code paths)")
    p.add_argument("--budgets", default=None, help="GPU budgets, comma separated (default 24GiB,48GiB; dry run tiny)")
    p.add_argument("--models", default="qwen2.5-1.5b,qwen2.5-3b,qwen2.5-7b", help="zoo names (ignored by --dry-run)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 1024; dry run 64)")
    p.add_argument("--time-budget-s", type=float, default=None, help="wall-clock budget (default 450; dry run 50)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per run")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run, median reported (3; dry run 2)")
    p.add_argument("--max-batch", type=int, default=None, help="largest micro-batch searched (default 32; dry run 8)")
    p.add_argument("--timing-batch", type=int, default=None, help="micro-batch of the layer timing (default 2; dry 1)")
    p.add_argument("--timing-passes", type=int, default=3, help="forward+backward passes of the layer timing")
    p.add_argument("--solver-time-limit", type=float, default=None, help="MILP seconds per solve (10; dry run 5)")
    p.add_argument("--skip-parity", action="store_true", help="skip the parity section")
    p.add_argument("--skip-optimizer", action="store_true", help="skip the host-CPU optimizer section")
    p.add_argument("--optim-params", type=int, default=None, help="parameters of the optimizer section (200M; dry 2M)")
    p.add_argument("--skip-plan-space", action="store_true", help="skip the plan-space section")
    p.add_argument("--only-plan-space", action="store_true", help="run only the environment and plan-space sections")
    p.add_argument(
        "--plan-space-cases",
        type=lambda s: [c for c in s.split(",") if c],
        default=list(PLAN_SPACE_CASES),
        help=f"plan-space cases, comma separated (default all: {','.join(PLAN_SPACE_CASES)})",
    )
    p.add_argument("--no-sanitizer", action="store_true", help="skip the CUDA stream sanitizer pass")
    p.add_argument("--plan-space-child", action="store_true", help=argparse.SUPPRESS)  # the sanitizer's child
    p.add_argument("--skip-cuda-semantics", action="store_true", help="skip the cuda_semantics section")
    p.add_argument(
        "--only-cuda-semantics", action="store_true", help="run only the environment and cuda_semantics sections"
    )
    p.add_argument(
        "--cuda-semantics-cases",
        type=lambda s: [c for c in s.split(",") if c],
        default=None,
        help="comma-separated subset of the cuda_semantics cases (default: all; see gpu_check_cuda.CASES)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        log("CUDA is not available: run with --dry-run for the CPU version of every section.")
        return 2
    bad = [c for c in args.plan_space_cases if c not in PLAN_SPACE_CASES]
    if bad:
        raise ValueError(f"--plan-space-cases: unknown {bad}; choose from {', '.join(PLAN_SPACE_CASES)}.")
    if not dry:
        # deterministic cuBLAS reductions (set before the first cuBLAS handle): plan-space parity is bit-exact
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.plan_space_child:
        return plan_space_child(args)
    device = torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
    args.budgets = (args.budgets or ("3MiB,6MiB" if dry else "24GiB,48GiB")).split(",")
    args.seq_len = args.seq_len or (64 if dry else 1024)
    args.max_batch = args.max_batch or (8 if dry else 32)
    args.steps = args.steps or (2 if dry else 3)
    args.timing_batch = args.timing_batch or (1 if dry else 2)
    args.solver_time_limit = args.solver_time_limit or (5.0 if dry else 10.0)
    budget = Budget(args.time_budget_s or (50.0 if dry else 400.0))
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(SEED)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "argv": sys.argv if argv is None else ["gpu_check.py", *argv],
        "dry_run": dry,
        "device": str(device),
        "time_budget_s": budget.seconds,
        "sections": {},
        "notes": [],
    }
    env = run_section(report, "environment", section_environment, device) or {}
    import gpu_check_cuda  # the cuda_semantics section (benchmarks/gpu_check_cuda.py)

    cuda_cases = args.cuda_semantics_cases or list(gpu_check_cuda.CASES)
    bad = [c for c in cuda_cases if c not in gpu_check_cuda.CASES]
    if bad:
        raise ValueError(f"--cuda-semantics-cases: unknown {bad}; choose from {', '.join(gpu_check_cuda.CASES)}.")
    if args.only_cuda_semantics:
        run_section(report, "cuda_semantics", gpu_check_cuda.section_cuda_semantics, device, dry, cuda_cases, budget)
        return finish(report, args, env, [], None, budget, device)
    if args.only_plan_space:
        run_section(
            report, "plan_space", section_plan_space, device, dry, args.plan_space_cases, not args.no_sanitizer, budget
        )
        return finish(report, args, env, [], None, budget, device)
    if not args.skip_parity:
        run_section(report, "parity", section_parity, device, dry)
    prof_res = run_section(report, "profile", section_profile, device, dry, args.out)
    if not args.skip_optimizer:
        params = args.optim_params or (2_000_000 if dry else 200_000_000)
        run_section(report, "optimizer", section_optimizer, dry, params)
    if not args.skip_plan_space:
        run_section(
            report, "plan_space", section_plan_space, device, dry, args.plan_space_cases, not args.no_sanitizer, budget
        )
    if not args.skip_cuda_semantics:
        run_section(report, "cuda_semantics", gpu_check_cuda.section_cuda_semantics, device, dry, cuda_cases, budget)
    from lazytrain_hf.planner import hardware

    if prof_res is not None:
        profile = hardware.HardwareProfile.from_dict(prof_res["profile"])
    else:
        profile = hardware.get_profile("cpu" if dry else "h200")
        report["notes"].append(f"profile section failed: models planned with the bundled {profile.name!r} profile")
    model_results = []
    for name, cfg in model_configs(dry, [m for m in args.models.split(",") if m]):
        if not budget.allows():
            note = f"{name}: skipped, time budget of {budget.seconds:.0f} s spent ({budget.elapsed():.0f} s)"
            report["notes"].append(note)
            log(f"\n== model:{name}\n   {note}")
            model_results.append({"model": name, "runs": [], "notes": [note]})
            continue
        res = run_section(report, f"model:{name}", section_model, name, cfg, device, profile, args, budget, args.out)
        model_results.append(res if res is not None else {"model": name, "runs": [], "notes": ["section failed"]})
    run_section(report, "prediction", section_prediction, model_results)

    # calibrated measured profile: achievable fraction from every model's measured layer times
    etas = [r["achievable_fraction"] for r in model_results if "achievable_fraction" in r]
    if prof_res is not None and etas:
        cal = dataclasses.replace(
            profile,
            achievable_fraction=statistics.median(etas),
            source=profile.source + f"; achievable_fraction from measured decoder-layer times of "
            f"{', '.join(r['model'] for r in model_results if 'achievable_fraction' in r)} (gpu_check)",
        )
        cal.to_json(prof_res["path"])
        report["calibrated_achievable_fraction"] = cal.achievable_fraction
    return finish(report, args, env, model_results, prof_res, budget, device)


def finish(report: dict, args, env: dict, model_results: list, prof_res, budget: Budget, device) -> int:
    """Write gpu_check.json / gpu_check.md, print the summary; 1 when a section failed."""
    import gpu_check_cuda

    from lazytrain_hf.planner import hardware

    dry = args.dry_run
    rows = summary_rows(model_results)
    elapsed = budget.elapsed()
    report["summary"] = rows
    report["elapsed_s"] = elapsed
    par = report["sections"].get("parity", {})
    par_line = (
        f"parity: {'ok' if par['result']['ok'] else 'FAILED'} ({par['result']['tolerance']})"
        if par.get("status") == "ok"
        else f"parity: {par.get('status', 'skipped')}"
    )
    prof_line = (
        "profile: " + hardware.HardwareProfile.from_json(prof_res["path"]).summary()
        if prof_res is not None
        else "profile: failed"
    )
    pred = report["sections"].get("prediction", {}).get("result") or {}
    header = [
        f"date {report['date']}, device {env.get('device_name', device)}"
        + (" (dry run: the 'GPU' is the CPU; peak = executor's accounted device peak)" if dry else ""),
        f"models bf16, seq {args.seq_len}, {args.warmup} warm-up + {args.steps} timed steps (median), budgets "
        f"{','.join(args.budgets)}",
        "TFLOPS = 6 * N * tokens / step time; N = all parameters (tied counted once); tokens = non-pad tokens from "
        "attention_mask (full-length batches here, so none are padding)",
        "pred% / sim% = (stage-model MILP / simulator step time - measured) / measured",
        par_line,
        prof_line,
        optimizer_line(report),
        plan_space_line(report),
        gpu_check_cuda.cuda_semantics_line(report),
        "max |pred err| "
        + ", max |sim err| ".join(
            "-" if pred.get(k) is None else f"{pred[k]:.1f}%" for k in ("max_abs_milp_err_pct", "max_abs_sim_err_pct")
        ),
        f"elapsed {elapsed:.1f} s of a {budget.seconds:.0f} s budget",
        *report["notes"],
    ]
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(markdown(report, rows, header))
    log("\n== summary")
    for h in header:
        log(h)
    log(text_table(rows))
    failed = [n for n, s in report["sections"].items() if s["status"] != "ok"]
    if failed:
        log(f"failed sections: {', '.join(failed)} (tracebacks in gpu_check.json)")
    ps = report["sections"].get("plan_space", {})
    if ps.get("status") == "ok" and not ps["result"]["ok"]:
        log("plan space: a case differs from its reference, failed or raced (details in gpu_check.json)")
        return 1
    cs = report["sections"].get("cuda_semantics", {})
    if cs.get("status") == "ok" and not cs["result"]["ok"]:
        log("cuda semantics: a case failed (details in gpu_check.json)")
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
