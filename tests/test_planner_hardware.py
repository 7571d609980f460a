"""Hardware profiles: bundled names, JSON round trip, measure() on this machine, errors; Plan JSON round trip."""

from __future__ import annotations

import json
import time

import pytest

from lazytrain_hf.planner import baselines, milp
from lazytrain_hf.planner.costmodel import CostModel
from lazytrain_hf.planner.hardware import BUNDLED_PROFILES, HardwareProfile, get_profile, measure
from lazytrain_hf.planner.plan import Plan, PlanError
from lazytrain_hf.planner.zoo import get_config


def test_bundled_profiles_round_trip(tmp_path):
    assert set(BUNDLED_PROFILES) == {"h800", "h100", "h200", "a100-80g", "rtx3090", "rtx4090", "cpu"}
    for name in BUNDLED_PROFILES:
        p = get_profile(name)
        path = tmp_path / f"{name}.json"
        p.to_json(str(path))
        assert get_profile(str(path)) == p
    cpu = get_profile("cpu")
    assert cpu.device_type == "cpu" and cpu.device_memory_bytes == 24 * 2**30 and 18 <= cpu.h2d_gbps <= 21
    assert get_profile("H800").device_memory_bytes == 80 * 2**30


def test_profile_errors(tmp_path):
    with pytest.raises(ValueError, match="h800, h100, h200, a100-80g, rtx3090, rtx4090, cpu"):
        get_profile("v100")
    with pytest.raises(ValueError, match="does not exist"):
        get_profile(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        get_profile(str(bad))
    data = get_profile("h800").to_dict()
    data["h2d_gbps"] = -1
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="h2d_gbps=-1"):
        get_profile(str(bad))
    data = get_profile("h800").to_dict()
    data["warp_drive"] = 1
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown hardware profile keys"):
        get_profile(str(bad))


def test_measure_is_fast_and_sane(tmp_path):
    path = tmp_path / "hw.json"
    t0 = time.perf_counter()
    p = measure(cache_path=str(path), device="cpu", nvme_dir=str(tmp_path))
    assert time.perf_counter() - t0 < 30
    assert path.exists() and HardwareProfile.from_json(str(path)) == p
    assert 0.5 < p.h2d_gbps < 500 and p.nvme_write_gbps > 0 and p.cpu_optimizer_params_per_s > 1e6
    assert 0.001 < p.peak_tflops < 100 and p.device_type == "cpu"
    # the CPU device measured per compute class at layer shapes, memory-bound passes and kernels; lanes serial
    assert set(p.efficiency) == {"gemm_bwd", "attention", "attention_bwd", "linear_attention", "moe"}
    assert all(0 < e <= 1 for e in p.efficiency.values()) and p.achievable_fraction == 1.0
    assert 0.05 < p.memory_gbps < 1000 and 0 < p.kernel_overhead_s < 1e-3 and p.serial_lanes
    assert measure(cache_path=str(path)) == p  # cached
    # a measured profile plans like a bundled one
    cm = CostModel.from_config(get_config("qwen2.5-3b"), p, 256, 1)
    plan = milp.solve(cm, gpu_budget=8 * 2**30, solver="cbc")
    assert plan.predicted["step_time_s"] > 0


def test_profile_class_rates_and_old_files(tmp_path):
    h800 = get_profile("h800")
    assert h800.rate("gemm") == pytest.approx(h800.flops_per_s)
    assert h800.rate("attention") == pytest.approx(989.5e12 * h800.efficiency["attention"])
    with pytest.raises(ValueError, match="compute_class='tensor'"):
        h800.rate("tensor")
    # a profile written before the per-class fields loads, and models neither memory passes nor kernels
    data = h800.to_dict()
    for key in ("memory_gbps", "kernel_overhead_s", "efficiency"):
        data.pop(key)
    old = HardwareProfile.from_dict(data)
    assert old.memory_gbps == 0 and old.rate("moe") == old.flops_per_s
    with pytest.raises(ValueError, match="efficiency key 'gemm'"):
        HardwareProfile.from_dict({**data, "efficiency": {"gemm": 0.5}})
    with pytest.raises(ValueError, match=r"efficiency\['moe'\]=1.5"):
        HardwareProfile.from_dict({**data, "efficiency": {"moe": 1.5}})


def test_measure_rejects_bad_arguments():
    with pytest.raises(ValueError, match="repeats=0"):
        measure(device="cpu", repeats=0)


def test_plan_json_round_trip(tmp_path):
    cm = CostModel.from_config(get_config("qwen3-30b-a3b"), "rtx3090", 1024, 2)
    for plan in (milp.solve(cm, solver="cbc"), baselines.make_baseline("megatrain", cm)):
        again = Plan.from_json(plan.to_json())
        assert again == plan
        path = tmp_path / "p.json"
        plan.to_json(str(path))
        assert Plan.from_json(str(path)) == plan
        # the megatrain plan's prediction is MegaTrain's own executor (baselines.evaluate_megatrain)
        evaluated = (
            baselines.evaluate_megatrain(cm, again.checkpoint_every)
            if again.source == "baseline:megatrain"
            else milp.evaluate_plan(again, cm)
        )
        assert evaluated.step_time_s == pytest.approx(plan.predicted["step_time_s"])
    assert "predicted:" in plan.table() and "solver" not in baselines.make_baseline("keep_all", cm).table()
    with pytest.raises(PlanError, match="unknown plan keys"):
        Plan.from_dict({**plan.to_dict(), "bogus": 1})
