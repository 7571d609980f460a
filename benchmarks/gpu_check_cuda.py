"""The ``cuda_semantics`` section of ``gpu_check.py``: the CUDA behaviours the CPU suite only imitates, on a GPU.

Run by ``gpu_check.py`` after the plan-space section (``--skip-cuda-semantics`` leaves it out,
``--only-cuda-semantics`` runs just it, ``--cuda-semantics-cases a,b`` a subset). It builds on the plan-space
section's sizes, training and comparison (``gpu_check_plan_space.py``) and the shared basics
(``gpu_check_common.py``), never on ``gpu_check.py`` itself. Cases (`CASES`), each guarded
(a failing case is a row with its traceback; the others still run):

- ``state_nvme_grad_accum``: training state of layers 1-2 on NVMe with gradient accumulation 2 and the optimizer
  overlapping the next forward, against the keep-all, no-overlap run with the same accumulation (bit-exact when the
  reference is deterministic on the device, else within the plan-space tolerance).
- ``tied_stream_embeddings``: a tied qwen3 with ``stream_embeddings``, two micro-batches through the handle: every
  gradient against the unstreamed model on the same device, no ``.grad`` left on the tied weight (on CUDA its data
  moves host <-> device between the lookup and the lm_head, giving it two gradient accumulators).
- ``generate_stream_embeddings``: ``generate()`` of a tied and an untied model with ``stream_embeddings``, inputs
  on ``model.device`` (the host while the embedding is unbound), tokens equal to the unstreamed model's.
- ``host_memory``: host RSS and locked memory (``VmRSS`` / ``VmLck`` of /proc/self/status) before ``attach``, after
  it, after a step, after ``remove()`` + ``del`` with the garbage collector off, and after a collection; the handle
  must be freed without the collector.
- ``host_syncs_every_thread``: one step whose backward needs an on-demand NVMe reload; which threads ran backward
  hooks and which threads' host synchronisations the trace counted (on CUDA backward runs on the autograd device
  thread).
- ``gpu_lag``: the plan-space cases again with the device lagging the host: ``torch.cuda._sleep`` on the compute
  stream before each decoder layer's forward and on each copy lane before its copies (`LAG_CYCLES`), every case
  bit-exact against its reference as in the plan-space section.

``--dry-run`` runs every case on the CPU under the simulated asynchronous engine; there the lag is the simulation's
(``LAZYTRAIN_SIMULATE_ASYNC_STALL_SHARE`` raised to `DRY_LAG_STALL_SHARE`, backward on its own thread:
``LAZYTRAIN_SIMULATE_AUTOGRAD_THREAD=1``) and the host-sync case stalls every NVMe read so the backward must wait.

Time on one H200 (estimate from the dry run's run counts, not measured): the cases train 2 + 1 + 0 + 1 + 1 small
models for a few steps (~10-15 s with imports warm) and ``gpu_lag`` reruns the plan-space section (8 cases + 6
reference runs of 6 steps on a 4-layer hidden-256 model, ~40 s there) with ~1 ms of device sleep per layer forward
and per copy batch (~4 layers x 2 passes + ~12 copy batches per step, ~20 ms per step, ~14 runs x 6 steps: ~2 s more):
~60-70 s in all. It runs before the model sections, which stop starting runs once the script's time budget (400 s)
is spent, so the whole script stays within its ~7-7.5 minutes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
import traceback
import weakref
from typing import Any

import torch
from gpu_check_common import build_model, log, make_batch, tiny_hf_config
from gpu_check_plan_space import (
    PLAN_SPACE_CASES,
    PLAN_SPACE_RTOL,
    compare_runs,
    plan_space_cases_run,
    plan_space_reference_plan,
    plan_space_sizes,
    plan_space_train,
)

CASES = (
    "state_nvme_grad_accum",
    "tied_stream_embeddings",
    "generate_stream_embeddings",
    "host_memory",
    "host_syncs_every_thread",
    "gpu_lag",
)
# ~1 ms of device sleep at the ~2 GHz clock of an H100/H200 SM: far longer than a tiny layer's kernels, so the host
# runs well ahead of the device and a missing wait reads data not yet there
LAG_CYCLES = 2_000_000
# the dry run's lag: a fifth of every simulated worker's jobs stall for longer than a forward
DRY_LAG_STALL_SHARE = "0.1"
# the dry run's lag pass trains each plan-space case for this many steps (the section itself uses its own count)
DRY_LAG_STEPS = 2
# tied_stream_embeddings on a device whose reference is not deterministic: relative L2 of each gradient (fp32)
GRAD_RTOL = 1e-5


@contextlib.contextmanager
def _env(**values: str | None):
    prev = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in prev.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _proc_status() -> dict[str, int]:
    """VmRSS and VmLck of this process in bytes (0 where /proc is missing)."""
    out = {"VmRSS": 0, "VmLck": 0}
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in out:
                out[key] = int(line.split()[1]) * 1024
    return out


def _sizes(dry_run: bool) -> dict[str, int]:
    return plan_space_sizes(dry_run)


def _config(dry_run: bool, tied: bool = True, hidden: int | None = None):
    sz = _sizes(dry_run)
    cfg = tiny_hf_config("qwen3", hidden=hidden or sz["hidden"], layers=sz["layers"], vocab=sz["vocab"])
    cfg.tie_word_embeddings = tied
    return cfg


def _plain_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------------------------- cases
def case_state_nvme_grad_accum(device: torch.device, dry_run: bool) -> dict[str, Any]:
    import tempfile

    from lazytrain_hf import models
    from lazytrain_hf.planner.plan import Plan

    sz = _sizes(dry_run)
    cfg = _config(dry_run)
    kinds = models.layer_kinds(cfg)
    plan = Plan.default(len(kinds), kinds, micro_batch_size=sz["micro_batch"], seq_len=sz["seq"], source="file")
    plan.state_nvme = [1, 2]
    plan.optimizer_overlap = True
    plan.validate()
    ref_plan = plan_space_reference_plan(kinds, sz["micro_batch"], sz["seq"], False)
    simulate = device.type == "cpu"
    with tempfile.TemporaryDirectory(prefix="gpu_check_state_nvme_") as tmp:
        run = plan_space_train(
            cfg, plan, 2, torch.float32, device, sz["steps"], simulate, tmp, {"state_nvme_dir": "<nvme>"}
        )
        ref = plan_space_train(cfg, ref_plan, 2, torch.float32, device, sz["steps"], False, tmp)
        again = plan_space_train(cfg, ref_plan, 2, torch.float32, device, sz["steps"], False, tmp)
    deterministic = compare_runs(again, ref)["bit_exact"]
    cmp = compare_runs(run, ref)
    tol = PLAN_SPACE_RTOL[torch.float32]
    ok = cmp["bit_exact"] if deterministic else cmp["max_loss_rel_err"] <= tol and cmp["weights_rel_l2"] <= tol
    return {
        "ok": bool(ok),
        "reference_deterministic": deterministic,
        "vs_reference": cmp,
        "step_time_s": run["step_time_s"],
        "plan": "state_nvme=[1, 2], gradient accumulation 2, overlap on",
    }


def case_tied_stream_embeddings(device: torch.device, dry_run: bool) -> dict[str, Any]:
    from lazytrain_hf import models
    from lazytrain_hf.planner.plan import Plan
    from lazytrain_hf.streaming import attach

    sz = _sizes(dry_run)
    cfg = _config(dry_run, tied=True)
    ref = build_model(cfg, torch.float32, torch.device("cpu")).to(device)
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    if not models.ties_embeddings(model):
        raise RuntimeError("tied_stream_embeddings: the model built from the tied config is not tied")
    kinds = models.layer_kinds(cfg)
    plan = Plan.default(
        len(kinds), kinds, micro_batch_size=sz["micro_batch"], seq_len=sz["seq"], stream_embeddings=True
    )
    handle = attach(model, plan=plan, device=device)
    stray = []
    try:
        for seed in (1, 2):
            b = make_batch(cfg.vocab_size, sz["micro_batch"], sz["seq"], device, seed=seed)
            (ref(**b).loss / 2).backward()
            (model(**b).loss / 2).backward()
            g = model.model.embed_tokens.weight.grad
            stray.append(None if g is None else float(g.float().norm()))
        got = {k: v.float().cpu() for k, v in handle.grads().items()}
    finally:
        handle.remove()
    want = _plain_grads(ref)
    exact = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    errs = {k: float((got[k] - want[k]).norm() / max(float(want[k].norm()), 1e-30)) for k in want if k in got}
    name = "model.embed_tokens.weight"
    ok = sorted(got) == sorted(want) and max(errs.values()) <= GRAD_RTOL and all(s is None for s in stray)
    return {
        "ok": bool(ok),
        "bit_exact": exact,
        "max_grad_rel_l2": max(errs.values()),
        "tied_grad_norm": float(got[name].norm()) if name in got else None,
        "tied_grad_norm_unstreamed": float(want[name].norm()),
        "stray_grad_norm_per_micro_batch": stray,
        "tolerance": f"relative L2 of each gradient <= {GRAD_RTOL:g}",
    }


def case_generate_stream_embeddings(device: torch.device, dry_run: bool) -> dict[str, Any]:
    from lazytrain_hf import models
    from lazytrain_hf.planner.plan import Plan
    from lazytrain_hf.streaming import attach

    rows = {}
    for tied in (True, False):
        cfg = _config(dry_run, tied=tied)
        cfg.use_cache = True
        ref = build_model(cfg, torch.float32, torch.device("cpu")).to(device).eval()
        model = build_model(cfg, torch.float32, torch.device("cpu")).eval()
        kinds = models.layer_kinds(cfg)
        handle = attach(model, plan=Plan.default(len(kinds), kinds, stream_embeddings=True), device=device)
        try:
            ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
            mask = torch.ones_like(ids)
            with torch.no_grad():
                want = ref.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=6,
                                    do_sample=False, pad_token_id=0).cpu()  # fmt: skip
                where = model.device  # the host while the embedding is unbound
                out = model.generate(input_ids=ids.to(where), attention_mask=mask.to(where), max_new_tokens=6,
                                     do_sample=False, pad_token_id=0).cpu()  # fmt: skip
        finally:
            handle.remove()
        rows["tied" if tied else "untied"] = {"equal": bool(torch.equal(out, want)), "inputs_on": str(where)}
    return {"ok": all(r["equal"] for r in rows.values()), "models": rows}


def case_host_memory(device: torch.device, dry_run: bool) -> dict[str, Any]:
    from lazytrain_hf import models
    from lazytrain_hf.planner.plan import Plan
    from lazytrain_hf.streaming import attach

    sz = _sizes(dry_run)
    cfg = _config(dry_run, hidden=None if dry_run else 1024)
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    kinds = models.layer_kinds(cfg)
    plan = Plan.default(len(kinds), kinds, micro_batch_size=sz["micro_batch"], seq_len=sz["seq"])
    gc.collect()
    points = {"before_attach": _proc_status()}
    handle = attach(model, plan=plan, device=device)
    points["after_attach"] = _proc_status()
    b = make_batch(cfg.vocab_size, sz["micro_batch"], sz["seq"], device)
    model(**b).loss.backward()
    handle.synchronize()
    points["after_step"] = _proc_status()
    host_store = sum(v for v in handle.store.host_bytes().values())
    ref = weakref.ref(handle)
    gc.disable()
    try:
        handle.remove()
        del handle
        freed = ref() is None
        points["after_remove_no_gc"] = _proc_status()
    finally:
        gc.enable()
    gc.collect()
    points["after_gc"] = _proc_status()
    lck0 = points["before_attach"]["VmLck"]
    ok = freed and points["after_remove_no_gc"]["VmLck"] <= lck0 + (1 << 20)
    return {
        "ok": bool(ok),
        "handle_freed_without_gc": freed,
        "host_store_bytes": int(host_store),
        "points": points,
        "note": "RSS need not fall back (the C allocator and the CUDA caching host allocator keep freed memory); "
        "locked memory must",
    }


def case_host_syncs_every_thread(device: torch.device, dry_run: bool) -> dict[str, Any]:
    import tempfile

    from lazytrain_hf import models
    from lazytrain_hf.planner.plan import Plan
    from lazytrain_hf.streaming import attach

    sz = _sizes(dry_run)
    cfg = _config(dry_run)
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    kinds = models.layer_kinds(cfg)
    plan = Plan.default(len(kinds), kinds, micro_batch_size=sz["micro_batch"], seq_len=sz["seq"])
    plan.layers[1].policy = "offload_nvme"
    plan.layers[1].reload_ahead = 0  # read back when unpacked: the backward waits for it
    plan.validate()
    sim = {"LAZYTRAIN_SIMULATE_AUTOGRAD_THREAD": "1", "LAZYTRAIN_SIMULATE_ASYNC_STALL_SHARE": "1",
           "LAZYTRAIN_SIMULATE_ASYNC_STALL_WORKERS": "nvme-read"} if device.type == "cpu" else {}  # fmt: skip
    hook_threads: set[str] = set()
    counted: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_syncs_") as tmp, _env(**sim):
        handle = attach(model, plan=plan, device=device, nvme_dir=tmp)
        trace = handle.trace
        real = trace.host_sync

        def host_sync(reason: str, step: int | None = None) -> None:
            name = threading.current_thread().name
            counted[name] = counted.get(name, 0) + 1
            real(reason, step)

        trace.host_sync = host_sync
        p = model.model.layers[0].mlp.down_proj.weight
        h = p.register_post_accumulate_grad_hook(lambda _: hook_threads.add(threading.current_thread().name))
        try:
            b = make_batch(cfg.vocab_size, sz["micro_batch"], sz["seq"], device)
            model(**b).loss.backward()
            reasons = dict(trace.current["sync_reasons"])
        finally:
            h.remove()
            handle.remove()
    training = threading.current_thread().name
    off_thread = {k: v for k, v in counted.items() if k != training}
    backward_elsewhere = bool(hook_threads - {training})
    return {
        # the backward ran on another thread and waited there: those waits must be counted
        "ok": (not backward_elsewhere) or bool(off_thread) or not reasons,
        "backward_hook_threads": sorted(hook_threads),
        "host_syncs_by_thread": counted,
        "sync_reasons": reasons,
    }


@contextlib.contextmanager
def gpu_lag(device: torch.device):
    """The device lags the host: ``torch.cuda._sleep(LAG_CYCLES)`` on the compute stream before every decoder layer's
    forward and on each copy lane before its copies. On the CPU: simulated workers stall (a share of
    `DRY_LAG_STALL_SHARE` of their jobs) and backward runs on its own thread."""
    if device.type != "cuda":
        with _env(LAZYTRAIN_SIMULATE_ASYNC_STALL_SHARE=DRY_LAG_STALL_SHARE, LAZYTRAIN_SIMULATE_AUTOGRAD_THREAD="1"):
            yield
        return
    from lazytrain_hf.streams import CudaLane

    real_copy_all = CudaLane.copy_all

    def lagging_copy_all(self, pairs, after=(), after_compute=False):
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            torch.cuda._sleep(LAG_CYCLES)
        return real_copy_all(self, pairs, after, after_compute)

    def before_layer(module, args):
        if type(module).__name__.endswith("DecoderLayer"):
            torch.cuda._sleep(LAG_CYCLES)

    CudaLane.copy_all = lagging_copy_all
    hook = torch.nn.modules.module.register_module_forward_pre_hook(before_layer)
    try:
        yield
    finally:
        hook.remove()
        CudaLane.copy_all = real_copy_all


def case_gpu_lag(device: torch.device, dry_run: bool) -> dict[str, Any]:
    names = list(PLAN_SPACE_CASES)
    det = None
    if device.type == "cuda":
        det = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with gpu_lag(device):
            out = plan_space_cases_run(device, dry_run, names, steps=DRY_LAG_STEPS if dry_run else None)
    finally:
        if det is not None:
            torch.use_deterministic_algorithms(det)
    rows = {
        n: {"ok": bool(r.get("ok")), "bit_exact": bool(r.get("vs_reference", {}).get("bit_exact")),
            "error": r.get("error")}  # fmt: skip
        for n, r in out["cases"].items()
    }
    return {
        "ok": all(r["ok"] for r in rows.values()),
        "lag": f"torch.cuda._sleep({LAG_CYCLES}) per layer forward and per lane copy batch"
        if device.type == "cuda"
        else f"simulated: stall share {DRY_LAG_STALL_SHARE}, backward on its own thread",
        "reference_deterministic": out.get("reference_deterministic"),
        "cases": rows,
    }


CASE_FNS = {
    "state_nvme_grad_accum": case_state_nvme_grad_accum,
    "tied_stream_embeddings": case_tied_stream_embeddings,
    "generate_stream_embeddings": case_generate_stream_embeddings,
    "host_memory": case_host_memory,
    "host_syncs_every_thread": case_host_syncs_every_thread,
    "gpu_lag": case_gpu_lag,
}


def section_cuda_semantics(device: torch.device, dry_run: bool, names: list[str], budget) -> dict[str, Any]:
    """Every case in ``names`` (see `CASES`), each guarded; one row per case. Cases left when the script's time
    budget is spent are skipped with a note."""
    out: dict[str, Any] = {"cases": {}}
    for name in names:
        if name not in CASE_FNS:
            raise ValueError(f"--cuda-semantics-cases: unknown case {name!r}; choose from {', '.join(CASES)}.")
        if not budget.allows():
            out["cases"][name] = {"status": "skipped", "ok": None, "note": "time budget spent"}
            log(f"   {name:<28} skipped (time budget spent)")
            continue
        t0 = time.perf_counter()
        # the dry run: every case on the simulated asynchronous engine (plan-space runs set it per run themselves)
        sim = _env(LAZYTRAIN_SIMULATE_ASYNC="1") if device.type == "cpu" else contextlib.nullcontext()
        try:
            with sim:
                row = {"status": "ok", **CASE_FNS[name](device, dry_run)}
        except Exception as e:  # a failing case is a result; the others still run
            row = {"status": "error", "ok": False, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()}  # fmt: skip
        row["seconds"] = round(time.perf_counter() - t0, 2)
        out["cases"][name] = row
        detail = row.get("error") or ", ".join(
            f"{k}={row[k]}" for k in ("bit_exact", "max_grad_rel_l2", "handle_freed_without_gc",
                                      "backward_hook_threads", "host_syncs_by_thread") if k in row  # fmt: skip
        )
        log(f"   {name:<28} {'ok' if row.get('ok') else 'FAILED':<7} {row['seconds']:>7.1f} s  {detail}"[:300])
        if name == "gpu_lag" and row["status"] == "ok":
            for n, r in row["cases"].items():
                exact = "exact" if r["bit_exact"] else ""
                log(f"      {n:<20} {'ok' if r['ok'] else 'FAILED'} {exact} {r['error'] or ''}")
    out["ok"] = all(r.get("ok") is not False for r in out["cases"].values())
    return out


def cuda_semantics_line(report: dict) -> str:
    sec = report["sections"].get("cuda_semantics", {})
    if sec.get("status") != "ok":
        return f"cuda semantics: {sec.get('status', 'skipped')}"
    cases = sec["result"]["cases"]
    good = sum(1 for r in cases.values() if r.get("ok"))
    return f"cuda semantics: {'ok' if sec['result']['ok'] else 'FAILED'} ({good}/{len(cases)} cases ok)"
