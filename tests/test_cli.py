"""`lazytrain plan` / `lazytrain simulate`: JSON keys, measured profile paths, timeline, errors, fast start."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lazytrain_hf.cli import main
from lazytrain_hf.planner.baselines import BASELINES
from lazytrain_hf.planner.hardware import measure
from lazytrain_hf.planner.plan import PREDICTION_KEYS

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_json_keys(capsys, tmp_path):
    code, out, _ = run(
        capsys,
        "plan",
        "--model",
        "qwen2.5-3b",
        "--hardware",
        "rtx3090",
        "--seq-len",
        "1024",
        "--json",
        "--max-batch-size",
        "64",
        "--timeline",
        str(tmp_path / "t.png"),
    )
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"plan", "predicted", "baselines", "max_batch_size", "solver"}
    assert set(data["predicted"]) == set(PREDICTION_KEYS)
    assert set(data["baselines"]) == set(BASELINES)
    for v in data["baselines"].values():
        assert v is None or set(v) == set(PREDICTION_KEYS)
    assert set(data["max_batch_size"]) == {"milp", *BASELINES}
    assert data["max_batch_size"]["milp"] >= max(data["max_batch_size"].values())
    # status, time and proven gap always; how presolve went and why a plan is not the solver's own when they apply
    assert {"status", "seconds", "gap"} <= set(data["solver"])
    assert set(data["solver"]) <= {"status", "seconds", "gap", "presolve", "stopped", "fallback", "kept"}
    assert len(data["plan"]["layers"]) == 36
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_with_measured_profile_and_simulate(capsys, tmp_path):
    hw = tmp_path / "hw.json"
    measure(cache_path=str(hw), device="cpu", nvme_dir=str(tmp_path))
    saved = tmp_path / "plan.json"
    code, out, _ = run(
        capsys,
        "plan",
        "--model",
        "qwen2.5-3b",
        "--hardware",
        str(hw),
        "--seq-len",
        "256",
        "--batch-size",
        "2",
        "--gpu-budget",
        "12GiB",
        "--max-batch-size",
        "8",
        "--save",
        str(saved),
    )
    assert code == 0 and "milp" in out and "megatrain" in out
    code, out, _ = run(
        capsys,
        "simulate",
        "--plan",
        str(saved),
        "--model",
        "qwen2.5-3b",
        "--hardware",
        str(hw),
        "--seq-len",
        "256",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    assert (
        abs(data["simulated"]["step_time_s"] - data["stage_model"]["step_time_s"])
        <= 0.05 * data["simulated"]["step_time_s"]
    )


def test_hf_config_path(capsys, tmp_path):
    from lazytrain_hf.planner.zoo import as_hf_config, get_config

    cfg = as_hf_config(get_config("qwen3-8b"))
    cfg.save_pretrained(str(tmp_path))
    code, out, _ = run(
        capsys,
        "plan",
        "--model",
        str(tmp_path),
        "--hardware",
        "h800",
        "--seq-len",
        "512",
        "--json",
        "--max-batch-size",
        "8",
    )
    assert code == 0 and len(json.loads(out)["plan"]["layers"]) == 36


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--model", "llama-7b", "--hardware", "h800", "--seq-len", "1024"], "not in the model zoo"),
        (["--model", "qwen3-8b", "--hardware", "tpu", "--seq-len", "1024"], "not a bundled profile"),
        (["--model", "qwen3-8b", "--hardware", "h800", "--seq-len", "0"], "--seq-len=0"),
        (
            ["--model", "qwen3-8b", "--hardware", "rtx3090", "--seq-len", "1024", "--gpu-budget", "1GiB"],
            "min_gpu_budget=",
        ),
    ],
)
def test_errors(capsys, argv, match):
    code, _, err = run(capsys, "plan", *argv)
    assert code in (2, 3) and match in err


def test_bad_budget_is_an_argument_error(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--model", "qwen3-8b", "--hardware", "h800", "--seq-len", "8", "--gpu-budget", "lots"])
    assert "--gpu-budget='lots'" in capsys.readouterr().err


def test_plan_does_not_import_trainer():
    code = (
        "import sys; from lazytrain_hf.cli import main; "
        "main(['plan','--model','qwen2.5-3b','--hardware','h800','--seq-len','256','--max-batch-size','4']); "
        "print('TRAINER' if 'transformers.trainer' in sys.modules else 'CLEAN')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("CLEAN"), out.stderr[-2000:]


# ----------------------------------------------------------------------------------------- refused before solving
@pytest.fixture
def no_solve(monkeypatch):
    """The checks below must fire before any solve."""
    from lazytrain_hf.planner import milp

    def solve(*args, **kwargs):
        raise AssertionError("the plan was solved before the bad argument was refused")

    monkeypatch.setattr(milp, "plan_for_model", solve)


def test_nan_in_a_hardware_profile_is_refused(capsys, tmp_path, no_solve):
    from lazytrain_hf.planner.hardware import get_profile

    hw = tmp_path / "nan.json"
    hw.write_text(json.dumps({**get_profile("h800").to_dict(), "peak_tflops": float("nan")}))  # json writes NaN
    code, _, err = run(capsys, "plan", "--model", "qwen2.5-3b", "--hardware", str(hw), "--seq-len", "256")
    assert code == 2
    for w in (f"--hardware={str(hw)!r}", "peak_tflops=nan", "positive finite", "measure()"):
        assert w in err, (w, err)


@pytest.mark.parametrize("flag", ["--save", "--timeline"])
@pytest.mark.parametrize("where", ["missing_dir", "a_directory", "read_only"])
def test_unwritable_output_path_is_an_argument_error(capsys, tmp_path, monkeypatch, no_solve, flag, where):
    if where == "missing_dir":
        path, fix = str(tmp_path / "no" / "such" / "out.json"), f"mkdir -p {tmp_path / 'no' / 'such'}"
    elif where == "a_directory":
        path, fix = str(tmp_path), "name a file in it"
    else:  # tests run as root, which writes through permission bits, so `os.access` is made to say no
        import os

        monkeypatch.setattr(os, "access", lambda p, mode: False)
        path, fix = str(tmp_path / "out.json"), "pick a path you can write to"
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "qwen2.5-3b", "--hardware", "h800", "--seq-len", "256", flag, path])
    assert e.value.code == 2
    err = capsys.readouterr().err
    for w in (f"{flag}={path!r}", fix):
        assert w in err, (w, err)


def test_gpu_budget_above_the_device_memory_is_refused(capsys, no_solve):
    code, _, err = run(
        capsys, "plan", "--model", "qwen3-8b", "--hardware", "h800", "--seq-len", "256", "--gpu-budget", "500GiB"
    )
    assert code == 2
    for w in ("--gpu-budget=500.00GiB", "h800", "80.00GiB", "at most --gpu-budget 80.00GiB"):
        assert w in err, (w, err)


def test_bad_search_time_limit_is_refused(capsys, no_solve):
    code, _, err = run(
        capsys, "plan", "--model", "qwen3-8b", "--hardware", "h800", "--seq-len", "256", "--auto-batch-size",
        "--search-time-limit", "0",
    )  # fmt: skip
    assert code == 2 and "--search-time-limit=0.0 must be > 0 seconds" in err, err


# ----------------------------------------------------------------------------------------- a data-parallel world
@pytest.mark.parametrize(
    "world,words",
    [
        (["--world-size", "0"], ["world_size=0 must be >= 1", "--world-size"]),
        (["--nodes", "0"], ["nodes=0 must be >= 1", "--nodes"]),
        (["--world-size", "3", "--nodes", "2"], ["world_size=3 is not a multiple of nodes=2", "--world-size"]),
        (["--world-size", "2", "--gradient-accumulation-steps", "0"], ["--gradient-accumulation-steps=0", ">= 1"]),
    ],
)
def test_bad_world_is_refused_before_solving(capsys, no_solve, world, words):
    code, _, err = run(capsys, "plan", "--model", "qwen2.5-3b", "--hardware", "h800", "--seq-len", "256", *world)
    assert code == 2 and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


def test_plan_world_prints_host_ram_per_node_and_rank_and_the_step(capsys, tmp_path):
    argv = ["plan", "--model", "qwen2.5-1.5b", "--hardware", "h800", "--seq-len", "512", "--batch-size", "2"]
    argv += ["--world-size", "4", "--nodes", "2", "--time-limit", "10"]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    for w in ("world: 4 ranks on 2 node(s), 2 per node", "host RAM per node:", "host RAM per rank: rank 0", "net"):
        assert w in out, (w, out[-2000:])
    assert "predicted step (slowest rank, simulated)" in out
    assert "gradients reduced on the devices" in out and "[simulated step: host" in out  # H800: NVLink
    code, out, _ = run(capsys, *argv, "--json", "--save", str(tmp_path / "plan.json"))
    data = json.loads(out)
    w = data["world"]
    assert (data["plan"]["world_size"], data["plan"]["nodes"]) == (4, 2)
    assert (w["world_size"], w["nodes"], w["ranks_per_node"]) == (4, 2, 2)
    assert len(w["host_bytes_per_node"]) == 2 and len(w["host_bytes_per_rank"]) == 4
    for n in range(2):  # the node's shared compute copy once, plus its two ranks (each at most its peak)
        ranks = w["host_bytes_per_rank"][2 * n : 2 * n + 2]
        assert (
            w["shared_compute_bytes"] + max(ranks)
            < w["host_bytes_per_node"][n]
            <= w["shared_compute_bytes"] + sum(ranks)
        )
    assert w["bytes_per_step_rank0"]["net"] > 0 and w["step_time_s"] > 0
    # where the gradients are reduced: the plan's choice, the shorter of the two simulated steps
    steps = w["dp_reduce_step_s"]
    assert w["dp_reduce"] == data["plan"]["dp_reduce"] == min(steps, key=steps.get) == "device"
    # the saved plan carries its world: `simulate` replays it on the net lane too
    code, out, _ = run(capsys, "simulate", *argv[1:7], "--plan", str(tmp_path / "plan.json"))
    assert code == 0 and "net      busy" in out
    # one rank: the output has no world block, as before
    code, out, _ = run(capsys, *argv[:9], "--json")
    assert (
        code == 0
        and "world" not in json.loads(out)
        and "net" not in json.loads(out)["plan"]["predicted"].get("bytes_per_step", {})
    )


def test_plan_world_with_gradient_accumulation_decides_how_often_to_reduce(capsys):
    """``--gradient-accumulation-steps 4``: the world's decision covers the once-per-step host reduce too (Note:
    [Gradients reduced once per step]); the printed cadence, the JSON and the host RAM are the plan's choice's."""
    argv = ["plan", "--model", "qwen2.5-1.5b", "--hardware", "rtx4090", "--seq-len", "512", "--batch-size", "2"]
    argv += ["--world-size", "2", "--time-limit", "10", "--gradient-accumulation-steps", "4"]
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    data = json.loads(out)
    w = data["world"]
    steps = w["dp_reduce_step_s"]
    print(steps, w["dp_reduce"], w["dp_reduce_every"])
    assert set(steps) == {"host", "device", "host/step"} and w["gradient_accumulation_steps"] == 4
    key = w["dp_reduce"] if w["dp_reduce_every"] == "micro_batch" else f"{w['dp_reduce']}/step"
    assert steps[key] == min(steps.values())
    assert (data["plan"]["dp_reduce"], data["plan"]["dp_reduce_every"]) == (w["dp_reduce"], w["dp_reduce_every"])
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "micro-batch(es)" in out
    assert ("once per optimizer step" in out) == (w["dp_reduce_every"] == "step")


def test_plan_stream_embeddings_auto_streams_where_only_that_fits(capsys):
    """``--stream-embeddings``: at a device budget below the least peak with Qwen2.5-7B's (untied) embedding and head
    resident (6.03 GiB at batch 4, device tier only), ``off`` refuses naming the budget it needs, ``on`` and ``auto``
    plan them streamed (4.58 GiB), and the plan printed is the one that fits."""
    argv = ["plan", "--model", "qwen2.5-7b", "--hardware", "rtx3090", "--seq-len", "1024", "--batch-size", "4"]
    argv += ["--tiers", "gpu", "--gpu-budget", "5.5GiB", "--time-limit", "10", "--json"]
    code, out, err = run(capsys, *argv)
    assert code != 0 and "min_gpu_budget=" in err
    for choice in ("on", "auto"):
        code, out, err = run(capsys, *argv, "--stream-embeddings", choice)
        assert code == 0, err
        data = json.loads(out)
        assert data["plan"]["stream_embeddings"] is True
        assert data["predicted"]["peak_gpu_bytes"] <= 5.5 * 2**30
        assert data["max_batch_size"]["milp"] >= 4
