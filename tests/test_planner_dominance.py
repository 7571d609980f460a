"""The MILP dominates every baseline: each baseline's plan is a point of the MILP (same step and memory with its
variables fixed), the warm start reaches HiGHS, a solve never returns worse than its start, and, as a property over
random zoo models x hardware x sequence x budget x tiers, the MILP fits at least every baseline's largest batch and is
no slower at a common batch, every plan judged by the simulator (`lazytrain_hf.planner.dominance`)."""

from __future__ import annotations

import time
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lazytrain_hf.planner import milp
from lazytrain_hf.planner.baselines import BASELINES, baseline_plan
from lazytrain_hf.planner.costmodel import CostModel
from lazytrain_hf.planner.dominance import dominance_record
from lazytrain_hf.planner.formulation import GIB, build_milp, extract_plan, set_warm_start
from lazytrain_hf.planner.plan import Plan
from lazytrain_hf.planner.simulate import simulate
from lazytrain_hf.planner.solver import run_solver
from lazytrain_hf.planner.stages import evaluate_plan
from lazytrain_hf.planner.zoo import ZOO_MODELS, get_config

pytest.importorskip("highspy")

POINTS = [("qwen2.5-1.5b", "h800", 1024, 8), ("qwen3-30b-a3b", "rtx4090", 1024, 2), ("qwen3.6-27b", "h200", 4096, 1)]


def overlapped(plan: Plan) -> Plan:
    """``plan`` with the optimizer overlapping the next forward, as every plan of the MILP."""
    return Plan.from_dict({**plan.to_dict(), "optimizer_overlap": True})


def fix_start(model) -> None:
    """Fix every binary to its initial value (the warm start): the model is left with that one point."""
    for v in model.prob.variables():
        if v.cat != "Continuous" and v.varValue is not None:
            v.lowBound = v.upBound = v.varValue


# ---------------------------------------------------------------------------------------------------- containment
@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("point", POINTS, ids=lambda p: f"{p[0]}-{p[1]}-{p[2]}-b{p[3]}")
def test_every_baseline_is_a_point_of_the_milp(name, point):
    """At the baseline's own peak as the device budget, its decisions fixed in the MILP give its step time (with the
    optimizer overlapped; without it the baseline is slower) and its peak, and extract back to the same plan."""
    model_name, hw, seq, batch = point
    cm = CostModel.from_config(get_config(model_name), hw, seq, batch)
    plan = baseline_plan(name, cm)
    ev = evaluate_plan(overlapped(plan), cm)
    tiers = tuple(sorted(plan.tiers_used()))
    host = max(ev.pinned_host_bytes, 1)
    for objective in ("time", "memory"):
        model = build_milp(cm, ev.peak_gpu_bytes, host, 0, tiers, 2, objective)
        assert set_warm_start(model, plan, 2, cm), f"{name} is not a point of the MILP"
        fix_start(model)
        rep = run_solver(model.prob, "highs", 60, 0.0, warm=False)
        assert rep["status"] == "optimal", rep
        if objective == "time":
            assert rep["objective"] == pytest.approx(ev.step_time_s, rel=1e-7)
            assert ev.step_time_s <= evaluate_plan(plan, cm).step_time_s
            if plan.optimizer_overlap:
                assert ev.step_time_s == evaluate_plan(plan, cm).step_time_s
            got = extract_plan(model, cm, "milp")
            assert got.checkpoint_every == plan.checkpoint_every
            assert [(lp.policy, lp.tier, lp.resident) for lp in got.layers] == [
                (lp.policy, lp.tier, lp.resident) for lp in plan.layers
            ]
            assert evaluate_plan(got, cm).step_time_s == pytest.approx(ev.step_time_s, rel=1e-12)
        else:
            assert rep["objective"] * GIB == pytest.approx(ev.peak_gpu_bytes, rel=1e-7)


# ---------------------------------------------------------------------------------------------------- warm start
@pytest.mark.parametrize("tiers", [("gpu",), ("gpu", "cpu")])
def test_solve_never_worse_than_the_best_baseline_or_its_warm_start(tiers):
    """A solve stopped early (1 s) still returns a plan no slower than every baseline that fits and than the
    caller's warm start (the previous batch's plan)."""
    cm = CostModel.from_config(get_config("qwen3-8b"), "rtx4090", 1024, 4)
    gpu, host = cm.hardware.default_gpu_budget(), cm.hardware.default_host_budget()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prev = milp.solve(cm.with_batch(8), gpu, host, 0, tiers, time_limit=10)
        prev.micro_batch_size = 4
        plan = milp.solve(cm, gpu, host, 0, tiers, time_limit=1, warm_start=prev)
    t = evaluate_plan(plan, cm).step_time_s
    for name in BASELINES:
        b = overlapped(baseline_plan(name, cm))
        ev = evaluate_plan(b, cm)
        if b.tiers_used() <= set(tiers) and ev.peak_gpu_bytes <= gpu and ev.pinned_host_bytes <= host:
            assert t <= ev.step_time_s, name
    assert t <= evaluate_plan(prev, cm).step_time_s


@pytest.mark.parametrize("name,hw", [("qwen2.5-3b", "rtx3090"), ("qwen3-30b-a3b", "h800")])
def test_lookahead_2_never_worse_than_lookahead_1(name, hw):
    """The lookahead-1 plan is a point of the lookahead-2 model and its start: the deeper solve is never slower."""
    cm = CostModel.from_config(get_config(name), hw, 1024, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = milp.solve(cm, lookahead=1, time_limit=5)
        two = milp.solve(cm, lookahead=2, time_limit=2, warm_start=one)
    # equal plans can differ in the last bits of a float sum: 1e-12 relative
    assert evaluate_plan(two, cm).step_time_s <= evaluate_plan(one, cm).step_time_s * (1 + 1e-12)


# ---------------------------------------------------------------------------------------------------- property
MODELS = st.sampled_from(list(ZOO_MODELS))
HARDWARE = st.sampled_from(["h800", "h100", "h200", "a100-80g", "rtx3090", "rtx4090"])
SEQ = st.sampled_from([1024, 4096])
BUDGET = st.floats(min_value=0.3, max_value=0.95)
TIERS = st.sampled_from([("gpu",), ("gpu", "cpu")])
_RECORDS: list[tuple[dict, float]] = []


def _check(model: str, hw: str, seq: int, budget: float, tiers: tuple[str, ...], time_limit: float):
    """The dominance record of one point, its timing kept for the summary and its findings printed."""
    t0 = time.perf_counter()
    rec = dominance_record(model, hw, seq, budget, tiers, time_limit=time_limit)
    _RECORDS.append((rec.point, time.perf_counter() - t0))
    ratio = rec.worst_simulated_ratio()
    print(f"{rec.point}: max batch {rec.max_batch}, batch {rec.common_batch}: simulated milp / best baseline {ratio}")
    # a plan that fits the MILP's own model but not the simulator is the models' disagreement, held by
    # test_stage_model_and_simulator_agree_on_offloaded_plan_memory below, not a plan the MILP misses
    for m in rec.misfits.values():
        print(f"  stage model vs simulator: {m}")
    return rec


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(MODELS, HARDWARE, SEQ, BUDGET, TIERS)
def test_milp_dominates_every_baseline(model, hw, seq, budget, tiers):
    rec = _check(model, hw, seq, budget, tiers, time_limit=2)
    assert not rec.violations(misfits=False), (rec.point, rec.violations())


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(MODELS, HARDWARE, SEQ, BUDGET, TIERS)
def test_milp_dominates_every_baseline_large(model, hw, seq, budget, tiers):
    rec = _check(model, hw, seq, budget, tiers, time_limit=5)
    assert not rec.violations(misfits=False), (rec.point, rec.violations())


def test_stage_model_and_simulator_agree_on_offloaded_plan_memory():
    """Found by the dominance property (qwen3-8b, rtx3090, seq 1024, budget 30%, gpu + cpu tiers): the MILP's plan at
    batch 7 (every layer ``offload_cpu``, backward fetches on demand) peaked at 7.147 GiB in the stage model, within
    its 7.2 GiB budget, and at 8.489 GiB in the simulator, which charged one layer's saved bytes more at the head
    stage. Both now charge the executor's memory model (`memmodel`): the MILP's plan there peaks at 7.067 GiB in
    both, but it now recomputes every layer rather than offloading. At 36% (8.64 GiB) the MILP's plan is again every
    layer ``offload_cpu`` (two kept), 8.504 GiB in both."""
    cm = CostModel.from_config(get_config("qwen3-8b"), "rtx3090", 1024, 7)
    gpu = int(0.36 * cm.hardware.device_memory_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = milp.solve(cm, gpu, cm.hardware.default_host_budget(), 0, ("gpu", "cpu"), 5, lookahead=1)
    ev, sim = evaluate_plan(plan, cm), simulate(plan, cm)
    print(f"stage model {ev.peak_gpu_bytes / 2**30:.3f} GiB, simulated {sim.peak_gpu_bytes / 2**30:.3f} GiB")
    assert ev.peak_gpu_bytes <= gpu
    assert sim.peak_gpu_bytes == pytest.approx(ev.peak_gpu_bytes, rel=0.05)


def test_start_candidates_keep_no_unit_with_state_on_nvme_resident():
    """A start the MILP settles on must be a point of its model: a unit whose training state is on NVMe is never
    resident there (`CostModel.with_state_nvme`), so a warm start that keeps one resident (the plan made before the
    state was placed on NVMe, as `plan_for_model` hands it over) is no candidate, however well it fits."""
    from lazytrain_hf.planner.warmstart import start_candidates

    cm = CostModel.from_config(get_config("qwen2.5-7b"), "h200", 1024, 1).with_state_nvme(range(4))
    budget = 2**50  # everything fits: only the NVMe rule can exclude the warm start
    warm = baseline_plan("keep_all", cm)
    for lp in warm.layers:
        lp.resident = True
    warm.source = "warm"
    cands = start_candidates(cm, budget, budget, budget, ("gpu", "cpu"), (warm,))
    assert cands, "no start candidate at all"
    bad = [(p.source, lp.index) for p in cands for lp in p.layers if lp.resident and lp.index in cm.state_nvme]
    assert not bad, f"candidates keep units with state on NVMe resident: {bad[:5]}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = milp.solve(cm, budget, budget, budget, ("gpu", "cpu"), time_limit=10, warm_start=warm)
    assert not any(lp.resident for lp in plan.layers if lp.index in cm.state_nvme), plan.solver
