"""`benchmarks/gpu_check.py --dry-run`: every section runs on the CPU with tiny configs, writes its JSON, Markdown and
measured hardware profile, and the profile plans with `lazytrain plan --hardware path.json`.

The plan-space section (every case against its keep-all, no-overlap reference, cases on the simulated asynchronous
engine) has its own runs: a fast subset of two cases, and every case with the sanitizer's child process (slow). The
full dry run (all sections, ~60-90 s here) is marked slow. So is the cuda_semantics section's own dry run (every case,
~70 s here); two of its cases run in the default profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from lazytrain_hf.planner import hardware

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")
# The dry run's own wall-clock budget is 50 s (it skips runs to stay inside it); imports and the final write come
# on top, so the process gets a little more before it counts as too slow.
LIMIT_S = 90


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--dry-run", "--skip-plan-space", "--skip-cuda-semantics", "--out", str(out)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2 * LIMIT_S,
    )
    wall = time.perf_counter() - t0
    return proc, out, wall


@pytest.mark.slow
def test_dry_run_finishes_ok_within_limit(dry_run):
    proc, _, wall = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert wall < LIMIT_S, f"dry run took {wall:.1f} s"
    # the short table comes last
    tail = proc.stdout.strip().splitlines()
    summary = tail.index("== summary")
    assert any(line.startswith("model ") and "TFLOPS" in line for line in tail[summary:])
    assert "elapsed" in proc.stdout
    assert any(line.startswith("optimizer (host CPU,") for line in tail[summary:])


@pytest.mark.slow
def test_json_sections_and_runs(dry_run):
    _, out, _ = dry_run
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] is True and report["device"] == "cpu"
    secs = report["sections"]
    names = ("environment", "parity", "profile", "optimizer", "model:tiny-qwen3", "model:tiny-qwen3_moe", "prediction")
    for name in names:
        assert name in secs, sorted(secs)
        assert secs[name]["status"] == "ok", secs[name].get("traceback")
        assert secs[name]["seconds"] >= 0
    opt = secs["optimizer"]["result"]
    rows = {r["optimizer"]: r for r in opt["rows"]}
    assert opt["params"] == 2_000_000 and opt["bandwidth_gb_s"]["in_place"] > 0
    assert rows["torch AdamW fused + clip_grad_norm_"]["x_torch_fused"] == 1.0
    for case in ("host norm + fused clip", "host norm + clip + bf16", "device norm (step only)"):
        r = rows[f"Hybrid8bit[{opt['backend']}] {case}"]
        assert r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["x_torch_fused"] == pytest.approx(
            rows["torch AdamW fused + clip_grad_norm_"]["median_ms"] / r["median_ms"]
        )
    parity = secs["parity"]["result"]
    assert parity["ok"] and "tolerance" in parity
    for mt in ("qwen3", "qwen3_moe"):
        vecs = parity["models"][mt]["vectors"]
        assert set(vecs) == {"all_keep", "all_offload_cpu", "all_recompute", "mixed_nvme"}
        for row in vecs.values():
            # on the CPU the plain model is deterministic, so the streamed HF-loss path must be bit-exact
            assert row["hf_loss"]["bit_exact_vs_plain_bf16"], row
            assert row["chunked_loss"]["rel_l2_vs_plain_bf16"] <= 5e-2
    ok_runs = [r for m in ("model:tiny-qwen3", "model:tiny-qwen3_moe") for r in secs[m]["result"]["runs"]]
    assert {r["plan"] for r in ok_runs} <= {"milp", "megatrain", "keep_all"}
    done = [r for r in ok_runs if r["status"] == "ok"]
    assert done, "no run finished inside the time budget"
    for r in done:
        for key in ("batch", "step_time_s", "tokens", "tflops", "peak_device_bytes", "predicted_step_s",
                    "simulated_step_s", "milp_err_pct", "sim_err_pct", "within_budget", "losses"):  # fmt: skip
            assert key in r, key
        assert r["step_time_s"] > 0 and r["tokens"] == r["batch"] * 64
        assert r["peak_device_bytes"] > 0
        assert all(v == v for v in r["losses"])  # finite
    for r in ok_runs:
        if r["status"] == "skipped":
            assert r["note"]
    pred = secs["prediction"]["result"]
    assert len(pred["rows"]) == len(done)
    assert report["summary"] and report["elapsed_s"] > 0


@pytest.mark.slow
def test_markdown_table(dry_run):
    _, out, _ = dry_run
    md = (out / "gpu_check.md").read_text()
    assert "| model | budget | plan |" in md
    assert "the 'GPU' is the CPU" in md
    assert "## Parity (bf16)" in md


@pytest.mark.slow
def test_measured_profile_loads_and_plans(dry_run):
    _, out, _ = dry_run
    path = str(out / "measured_profile.json")
    prof = hardware.get_profile(path)
    assert prof.device_type == "cpu" and prof.name == "measured-cpu"
    assert 0 < prof.achievable_fraction <= 1
    per_model = hardware.get_profile(str(out / "measured_profile_tiny-qwen3.json"))
    assert per_model.layer_times and per_model.layer_times_shape == [1, 64]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "lazytrain_hf.cli", "plan", "--model", "qwen2.5-1.5b", "--hardware", path,
         "--seq-len", "256", "--batch-size", "1", "--json"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["plan"]["hardware"] == "measured-cpu"
    assert got["predicted"]["step_time_s"] > 0


# ---------------------------------------------------------------------------------------------------------- plan space
def run_plan_space(out, cases: list[str], sanitizer: bool):
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, SCRIPT, "--dry-run", "--only-plan-space", "--plan-space-cases", ",".join(cases)]
    cmd += ["--out", str(out)] + ([] if sanitizer else ["--no-sanitizer"])
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    report = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else None
    return proc, report


def check_plan_space(proc, report, cases: list[str], sanitizer: bool) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    sec = report["sections"]["plan_space"]
    assert sec["status"] == "ok", sec.get("traceback")
    res = sec["result"]
    assert res["reference_deterministic"] is True  # the CPU is deterministic: every case must be bit-exact
    assert sorted(res["cases"]) == sorted(cases)
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["case", "ok"])
    rows = {line.split()[0]: line.split() for line in lines[header + 1 : header + 1 + len(cases)]}
    assert sorted(rows) == sorted(cases), lines[header : header + 1 + len(cases)]
    for name in cases:
        row = res["cases"][name]
        assert row["status"] == "ok", row.get("traceback")
        cmp = row["vs_reference"]
        assert row["ok"] and cmp["bit_exact"], (name, cmp)
        assert cmp["losses_compared"] == res["sizes"]["steps"] * row["gradient_accumulation"]
        assert row["check"] == "bit-exact"
        assert row["step_time_s"] > 0 and row["peak_device_bytes"] > 0
        syncs = row["host_syncs_per_step"]
        assert syncs is None or (len(syncs) == res["sizes"]["steps"] and all(n >= 0 for n in syncs))
        assert rows[name][1] == "True" and rows[name][2] == "exact"
        assert rows[name][5] == ("n/a" if syncs is None else f"{sorted(syncs)[len(syncs) // 2]:g}")
    if "stream_embeddings" in cases:
        plain = res["cases"]["stream_embeddings"]["vs_keep_all_without_stream_embeddings"]
        assert plain["max_loss_rel_err"] <= 1e-4 and plain["weights_rel_l2"] <= 1e-4
    san = res["sanitizer"]
    if sanitizer:
        # no CUDA here: the child runs every case without the sanitizer, and says so
        assert san["enabled"] is False and "needs CUDA" in san["note"] and san["status"] == "ok", san
        assert sorted(san["cases"]) == sorted(cases)
        assert all(c["status"] == "ok" and not c["race"] for c in san["cases"].values()), san["cases"]
    else:
        assert san["status"] == "skipped"
    assert any(line.startswith("plan space: ok") for line in lines)


FAST_CASES = ["nvme", "block_recompute"]


@pytest.mark.slow  # 35-60 s under load: kept out of CI's default run
def test_plan_space_fast_subset(tmp_path):
    """Two cases (NVMe tier with a recompute input on NVMe; block recompute), no sanitizer child: ~15 s."""
    proc, report = run_plan_space(tmp_path, FAST_CASES, sanitizer=False)
    check_plan_space(proc, report, FAST_CASES, sanitizer=False)


@pytest.mark.slow
def test_plan_space_every_case_and_sanitizer_child(tmp_path):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from gpu_check import PLAN_SPACE_CASES

    cases = list(PLAN_SPACE_CASES)
    assert len(cases) == 8
    proc, report = run_plan_space(tmp_path, cases, sanitizer=True)
    check_plan_space(proc, report, cases, sanitizer=True)


def test_plan_space_unknown_case_is_refused(tmp_path):
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--dry-run", "--only-plan-space", "--plan-space-cases", "default,fastest",
         "--out", str(tmp_path)],
        env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "fastest" in proc.stderr and "choose from" in proc.stderr


# ------------------------------------------------------------------------------------------------- cuda semantics
def run_cuda_semantics(out, cases: list[str] | None):
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, SCRIPT, "--dry-run", "--only-cuda-semantics", "--out", str(out)]
    cmd += ["--cuda-semantics-cases", ",".join(cases)] if cases else []
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    report = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else None
    return proc, report


def check_cuda_semantics(proc, report, cases: list[str]) -> dict:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    sec = report["sections"]["cuda_semantics"]
    assert sec["status"] == "ok", sec.get("traceback")
    res = sec["result"]
    assert sorted(res["cases"]) == sorted(cases)
    for name, row in res["cases"].items():
        assert row["status"] == "ok" and row["ok"] is True, (name, row.get("error"), row.get("traceback"))
        assert row["seconds"] >= 0
    assert res["ok"] and any(line.startswith("cuda semantics: ok") for line in proc.stdout.splitlines())
    return res["cases"]


def test_cuda_semantics_tied_and_generate(tmp_path):
    """The tied + stream_embeddings gradients (against the unstreamed model) and generate() with stream_embeddings,
    on the simulated asynchronous engine: ~15 s."""
    cases = ["tied_stream_embeddings", "generate_stream_embeddings"]
    rows = check_cuda_semantics(*run_cuda_semantics(tmp_path, cases), cases)
    tied = rows["tied_stream_embeddings"]
    assert tied["max_grad_rel_l2"] <= 1e-5 and tied["stray_grad_norm_per_micro_batch"] == [None, None]
    assert tied["tied_grad_norm"] == pytest.approx(tied["tied_grad_norm_unstreamed"], rel=1e-5)
    assert rows["generate_stream_embeddings"]["models"]["tied"]["inputs_on"] == "cpu"


@pytest.mark.slow
def test_cuda_semantics_every_case(tmp_path):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from gpu_check_cuda import CASES

    rows = check_cuda_semantics(*run_cuda_semantics(tmp_path, None), list(CASES))
    assert rows["state_nvme_grad_accum"]["vs_reference"]["bit_exact"]
    mem = rows["host_memory"]
    assert mem["handle_freed_without_gc"] and mem["host_store_bytes"] > 0
    assert set(mem["points"]) == {"before_attach", "after_attach", "after_step", "after_remove_no_gc", "after_gc"}
    syncs = rows["host_syncs_every_thread"]
    # the dry run runs backward on the simulated autograd thread and stalls every NVMe read: its waits are counted
    assert syncs["backward_hook_threads"] == ["lazytrain-sim-autograd"]
    assert syncs["host_syncs_by_thread"].get("lazytrain-sim-autograd", 0) > 0, syncs
    lag = rows["gpu_lag"]["cases"]
    assert sorted(lag) == sorted(__import__("gpu_check").PLAN_SPACE_CASES)
    assert all(r["ok"] and r["bit_exact"] for r in lag.values()), lag


def test_cuda_semantics_unknown_case_is_refused(tmp_path):
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--dry-run", "--only-cuda-semantics", "--cuda-semantics-cases", "tied,fastest",
         "--out", str(tmp_path)],
        env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "fastest" in proc.stderr and "choose from" in proc.stderr
