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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

import torch

GiB = 2**30
# bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 2e-3 per operation); through a 4-layer model and its
# backward the relative L2 error of all gradients together against fp32 stays a few 1e-2 (single tensors can be far
# off in a MoE, where bf16 rounding flips which experts a token is routed to, so the check is on all gradients).
# Tensors whose fp32 norm is below PARITY_ATOL are compared absolutely.
PARITY_RTOL = 5e-2
PARITY_ATOL = 1e-6
SEED = 0


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------------- configs
def tiny_hf_config(model_type: str, hidden: int = 64, layers: int = 4, vocab: int = 512):
    from transformers import AutoConfig

    kw: dict[str, Any] = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        use_cache=False,
    )
    if model_type == "qwen3_moe":
        kw.update(moe_intermediate_size=hidden // 2, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
    return AutoConfig.for_model(model_type, **kw)


def model_configs(dry_run: bool, names: list[str]) -> list[tuple[str, Any]]:
    """``(name, HF config)`` per model size to measure."""
    if dry_run:
        return [(f"tiny-{t}", tiny_hf_config(t)) for t in ("qwen3", "qwen3_moe")]
    from lazytrain_hf.planner.zoo import as_hf_config, get_config

    return [(n, as_hf_config(get_config(n), use_cache=False)) for n in names]


# ---------------------------------------------------------------------------------------------------- models
def build_model(config: Any, dtype: torch.dtype, init_device: torch.device, seed: int = SEED) -> torch.nn.Module:
    """A causal LM of ``config`` on the CPU in ``dtype`` with random weights, built without the default init.

    Parameters are created on the meta device (buffers such as rotary frequencies are built normally), then
    materialised one at a time on the host: drawn on ``init_device`` (the GPU when there is one, which is far faster
    than the CPU for billions of values) and copied over. Values: N(0, initializer_range) for matrices, ones for norm
    weights, zeros for biases. Tied parameters stay one parameter.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    std = float(getattr(config, "initializer_range", 0.02))
    gen = torch.Generator(device=init_device).manual_seed(seed)
    done: dict[int, torch.nn.Parameter] = {}
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) in done:
                mod._parameters[pname] = done[id(p)]
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            data = torch.empty(p.shape, dtype=dtype, device="cpu")
            if p.dim() == 1 and "norm" in full:
                data.fill_(1.0)
            elif p.dim() == 1:
                data.zero_()
            else:
                data.copy_(torch.randn(p.shape, generator=gen, device=init_device, dtype=torch.float32).mul_(std))
            new = torch.nn.Parameter(data, requires_grad=p.requires_grad)
            done[id(p)] = new
            mod._parameters[pname] = new
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # the model built under init_empty_weights is not tied yet
    model.train()
    return model


def make_batch(vocab: int, batch: int, seq: int, device: torch.device, seed: int = 1) -> dict[str, torch.Tensor]:
    """Full-length random sequences (no padding); the attention mask is passed so tokens are counted from it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones_like(ids).to(device),
        "labels": ids.clone().to(device),
    }


def count_params(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    n = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    # Only the CUDA caching allocator holds memory for dropped models; on the CPU a full collection (~0.2 s with
    # transformers imported) buys nothing.
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- guard
class Budget:
    """Global wall-clock budget: callers ask before starting work they can skip."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.t0 = time.perf_counter()
        self.slowdowns: list[float] = []  # measured / simulated step time of every run so far

    def run_estimate(self, sim_step_s: float, steps: int, setup_s: float) -> float:
        """Seconds a run of ``steps`` steps is expected to take, from the simulated step time corrected by how far
        measured runs have been from their simulation so far."""
        slow = statistics.median(self.slowdowns) if self.slowdowns else 1.0
        return 1.5 * steps * slow * sim_step_s + setup_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def allows(self, estimate_s: float = 0.0) -> bool:
        return self.elapsed() + estimate_s <= self.seconds


def run_section(report: dict, name: str, fn, *args, **kwargs) -> Any:
    """Run one section; record ok/error (with traceback) and its seconds in ``report["sections"][name]``."""
    log(f"\n== {name}")
    t0 = time.perf_counter()
    entry: dict[str, Any] = {"status": "ok"}
    result = None
    try:
        result = fn(*args, **kwargs)
        entry["result"] = result
    except Exception as e:  # recorded; the remaining sections still run
        entry.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        log(f"   section {name} failed: {type(e).__name__}: {e}")
    entry["seconds"] = round(time.perf_counter() - t0, 3)
    report["sections"][name] = entry
    return result


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


def _median_or_na(xs: list[int] | None) -> str:
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
    cmd = [sys.executable, os.path.abspath(__file__), "--plan-space-child", "--plan-space-cases", ",".join(names),
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
            f"{_median_or_na(row['host_syncs_per_step']):>10}  {s:<10} {row['plan']}"
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
                f"{(row['peak_device_bytes'] or 0) / 2**20:.2f} | {_median_or_na(row['host_syncs_per_step'])} | "
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
