"""What one MILP solve returns: the solver's plan, a better plan it was started from, or a fallback said out loud.

Owns `settle`: given the solver's report, the plan extracted from its solution (or none) and the plans the solve
held before it ran (the caller's warm start, the lookahead-1 plan, the heuristic plan: every one fits the budgets),
it returns the fastest of them by the stage model's exact evaluation, fills in ``plan.predicted`` and
``plan.solver`` (status, seconds, proven gap, objective, presolve, and ``fallback`` / ``kept`` with the reason),
and warns with `PlannerFallbackWarning` whenever the plan is not the solver's own. Knows neither PuLP nor the
solver; imports neither torch nor pulp.

Note: [A solve never returns worse than what it started from]
    A plan the solve held before it ran is a feasible point, and the solver's incumbent at a time limit can be
    worse than it (a lookahead-2 solve stopped at its limit returned a plan up to 1.45% slower than the lookahead-1
    plan it was started from, in 24 of 75 pairs, when the warm start never reached HiGHS). So the returned plan is
    the best by `evaluate_plan` of the solver's plan and those held plans, and ``plan.solver["kept"]`` says when a
    held plan won.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from .costmodel import CostModel
from .plan import Plan
from .stages import evaluate_plan


class PlannerFallbackWarning(UserWarning):
    """The MILP solver gave no plan (or an unproven one was beaten) and another plan is used; the message says why."""


def settle(
    solved: Plan | None,
    rep: dict[str, Any],
    held: Sequence[Plan],
    cm: CostModel,
    solver_name: str,
    time_limit: float,
) -> Plan:
    """The plan one solve returns (See Note: [A solve never returns worse than what it started from]).

    Args:
        solved: the plan extracted from the solver's solution, or None when it has none.
        rep: the solver's report (`solver.run_solver`).
        held: plans that fit the budgets, held before the solve ran (warm start, lookahead-1, heuristic).
        time_limit: the solve's time limit (named in the messages).
    """
    timed = [(evaluate_plan(p, cm).step_time_s, k, p) for k, p in enumerate(held) if p.num_layers == cm.num_layers]
    best_held = min(timed, key=lambda t: (t[0], t[1]))[2] if timed else None
    why = f"{rep.get('solver_result')} after {rep['seconds']:.1f} s"
    if rep.get("presolve") not in (None, "on"):
        why += f", presolve {rep['presolve']}"
    fallback = kept = None
    if solved is None:
        if best_held is None:
            raise RuntimeError(f"the MILP solver returned no plan ({why}) and no plan was held to fall back on.")
        plan = best_held
        fallback = (
            f"MILP solver returned no plan ({why}); using the {_name(plan)} plan instead. Raise time_limit (now "
            f"{time_limit} s) or install highspy."
        )
        warnings.warn(fallback, PlannerFallbackWarning, stacklevel=3)
    else:
        plan = solved
        t_solved = evaluate_plan(solved, cm).step_time_s
        if best_held is not None and evaluate_plan(best_held, cm).step_time_s < t_solved:
            t_held = evaluate_plan(best_held, cm).step_time_s
            kept = (
                f"the {_name(best_held)} plan the solve started from: the solver's plan ({rep['status']}, gap "
                f"{rep.get('gap')}) evaluates {100 * (t_solved / t_held - 1):.2f}% slower"
            )
            plan = best_held
        if rep["status"] != "optimal":
            warnings.warn(
                f"MILP stopped before proving optimality ({why}, gap={rep.get('gap')}); using "
                f"{'its best plan' if kept is None else kept}. Raise time_limit (now {time_limit} s) for a better "
                "one.",
                PlannerFallbackWarning,
                stacklevel=3,
            )
    plan = Plan.from_dict(plan.to_dict())  # never alias a plan the caller holds
    plan.predicted = evaluate_plan(plan, cm).predictions()
    status = rep["status"]
    if fallback is not None:
        status = f"heuristic ({status})" if plan.source == "heuristic" else f"fallback ({status})"
    plan.solver = {
        "status": status,
        "seconds": rep["seconds"],
        "gap": rep.get("gap"),
        "name": solver_name,
        "objective": rep.get("objective"),
        "bound": rep.get("bound"),
    }
    for key in ("presolve", "stopped"):
        if rep.get(key) is not None:
            plan.solver[key] = rep[key]
    if fallback is not None:
        plan.solver["fallback"] = fallback
    if kept is not None:
        plan.solver["kept"] = kept
    return plan


def _name(plan: Plan) -> str:
    if plan.source == "heuristic":
        return "heuristic"
    if plan.source == "milp" and plan.solver.get("lookahead") == 1:
        return "lookahead-1 MILP"
    return f"{plan.source} (warm start)"
