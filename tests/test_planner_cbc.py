"""The CBC path keeps its promises too: a CBC solve ends by its time limit measured by the wall clock, whatever CBC
does with its own limit (See Note: [CBC's own time limit is not the wall clock]); it reports its incumbent and
proven gap; a CBC stopped without a solution gives the fallback with its reason; and a CBC that is missing or a
solver name that is wrong is an error naming the option, the value and the fix."""

from __future__ import annotations

import os
import stat
import time
import warnings

import pytest
from helpers.big_shapes import QWEN3_235B

from lazytrain_hf.planner import milp
from lazytrain_hf.planner.costmodel import CostModel
from lazytrain_hf.planner.formulation import build_milp
from lazytrain_hf.planner.solver import resolve_solver, run_solver
from lazytrain_hf.planner.zoo import get_config

pulp = pytest.importorskip("pulp")

STALL_S = 30  # how long the stalled CBC below sits before it starts solving


def _stalled_cbc(tmp_path, monkeypatch, ignore_sigint: bool = False) -> None:
    """Replace PuLP's bundled CBC by one that stalls `STALL_S` seconds before it even reads the model (as CBC's
    preprocessing or its root LP can, neither of which looks at CBC's ``-sec``), then runs the real CBC. With
    ``ignore_sigint`` the stall ignores SIGINT (as a CBC started from a background job may); the pids of the
    wrapper and of its stall are written to ``pids``."""
    real = pulp.PULP_CBC_CMD.pulp_cbc_path
    fake = tmp_path / "cbc"
    trap = "trap '' INT\n" if ignore_sigint else ""
    fake.write_text(
        f'#!/bin/sh\n{trap}sleep {STALL_S} &\necho $$ $! > "{tmp_path / "pids"}"\nwait $!\nexec "{real}" "$@"\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(pulp.PULP_CBC_CMD, "pulp_cbc_path", str(fake))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def _model(lookahead: int = 2):
    cm = CostModel.from_config(get_config("qwen3-8b"), "h800", 1024, 4)
    gpu, host = cm.hardware.default_gpu_budget(), cm.hardware.default_host_budget()
    return cm, gpu, host, build_milp(cm, gpu, host, 0, ("gpu", "cpu"), lookahead, "time")


@pytest.mark.parametrize("ignore_sigint", [False, True], ids=["stops-on-sigint", "ignores-sigint"])
def test_stalled_cbc_ends_by_its_time_limit(tmp_path, monkeypatch, ignore_sigint):
    """A CBC that stalls far past its limit is stopped at the deadline (by SIGINT, else killed with all it runs);
    the report says so and has no solution. Before the wall-clock bound, this solve with a 2 s limit took the whole
    stall (~31 s)."""
    _stalled_cbc(tmp_path, monkeypatch, ignore_sigint)
    _, _, _, model = _model()
    limit = 2.0
    t0 = time.perf_counter()
    rep = run_solver(model.prob, "cbc", limit, 0.01, warm=False)
    took = time.perf_counter() - t0
    assert took <= 3 * limit + 10, f"a CBC solve with time_limit={limit} s took {took:.1f} s"
    assert rep["status"] == "no_solution" and not rep["has_solution"] and rep["stopped"], rep
    assert "deadline" in rep["solver_result"], rep["solver_result"]
    if ignore_sigint:
        assert "killed" in rep["solver_result"], rep["solver_result"]
    if os.path.isdir("/proc"):  # nothing of it is left running
        pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
        t_end = time.perf_counter() + 5  # a killed process takes a moment to go
        while any(_alive(p) for p in pids) and time.perf_counter() < t_end:
            time.sleep(0.05)
        assert not [p for p in pids if _alive(p)], pids


def test_stalled_cbc_falls_back_with_its_reason(tmp_path, monkeypatch):
    """`milp.solve` with a stalled CBC ends by its limit with the heuristic plan, and says why (warning and
    ``plan.solver["fallback"]``)."""
    _stalled_cbc(tmp_path, monkeypatch)
    cm, gpu, host, _ = _model()
    limit = 4.0
    t0 = time.perf_counter()
    with pytest.warns(milp.PlannerFallbackWarning, match="deadline"):
        plan = milp.solve(cm, gpu, host, solver="cbc", time_limit=limit)
    took = time.perf_counter() - t0
    assert took <= 3 * limit + 10, f"milp.solve with time_limit={limit} s took {took:.1f} s"
    assert plan.source == "heuristic" and plan.solver["status"] == "heuristic (no_solution)", plan.solver
    assert "deadline" in plan.solver["fallback"] and "time_limit" in plan.solver["fallback"]


def test_cbc_reports_its_incumbent_and_proven_gap(monkeypatch):
    """A warm-started CBC solve with gap 0 stopped by its own limit on a model it does not prove within it: the
    incumbent (no worse than the start, a point of the model) comes back with CBC's proven bound and their gap.
    CBC's own limit is set to ~40% of the 10 s here so that even a loaded machine leaves it time to write its
    solution before the deadline."""
    from lazytrain_hf.planner import cbc_run
    from lazytrain_hf.planner.formulation import set_warm_start

    monkeypatch.setattr(cbc_run, "_MARGIN_SHARE", 0.6)
    cm = CostModel.from_config(QWEN3_235B, "h200", 8192, 4)
    gpu, host = 126_900_000_000, 824_633_720_832  # `plan_for_model`'s defaults on h200
    model = build_milp(cm, gpu, host, 0, ("gpu", "cpu"), 2, "time")
    start = milp.heuristic_plan(cm, gpu, host, 0, ("gpu", "cpu"))
    assert start is not None and set_warm_start(model, start, 2, cm)
    rep = run_solver(model.prob, "cbc", 10.0, 0.0, warm=True)
    assert rep["has_solution"] and rep["status"] in ("optimal", "time_limit") and not rep["stopped"], rep
    obj, bound = rep["objective"], rep["bound"]
    assert obj is not None and bound is not None and bound <= obj, rep
    assert obj <= milp.evaluate_plan(start, cm).step_time_s * (1 + 1e-6)
    assert rep["gap"] == pytest.approx((obj - bound) / obj, rel=1e-9, abs=1e-12), rep
    if rep["status"] == "time_limit":
        assert "time limit" in rep["solver_result"].lower() and rep["gap"] > 0, rep
    # the values PuLP holds are the incumbent's: they satisfy the model and give its objective
    assert model.prob.valid(eps=1e-6)
    assert pulp.value(model.prob.objective) == pytest.approx(obj, rel=1e-9)


def test_cbc_plan_records_objective_bound_and_gap():
    cm, gpu, host, _ = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", milp.PlannerFallbackWarning)
        plan = milp.solve(cm, gpu, host, solver="cbc", time_limit=20)
    s = plan.solver
    assert s["name"] == "cbc" and s["status"] in ("optimal", "time_limit"), s
    assert s["objective"] is not None and s["bound"] is not None and s["gap"] is not None, s
    assert s["bound"] <= s["objective"] * (1 + 1e-9) and 0 <= s["gap"] <= 0.01 + 1e-9, s


def test_bad_solver_name_names_option_value_and_fix():
    with pytest.raises(ValueError, match=r"solver='gurobi'.*'auto'.*'cbc'.*'highs'"):
        resolve_solver("gurobi")
    with pytest.raises(ValueError, match=r"solver='CBC'.*'cbc'"):
        milp.solve(_model()[0], solver="CBC")


def test_missing_cbc_names_option_and_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(pulp.PULP_CBC_CMD, "pulp_cbc_path", str(tmp_path / "no-cbc-here"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ImportError, match=r"solver='cbc'.*no-cbc-here.*pip install highspy"):
        resolve_solver("cbc")
    assert not os.path.exists(tmp_path / "no-cbc-here")
