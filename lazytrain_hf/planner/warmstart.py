"""The start candidates the MILP is seeded with, and the guard that a solve never returns worse than its start.

Owns: `start_candidates` (the plans a solve may start from, best first: the caller's warm start, the coarse
solve, the heuristic plan and every fixed baseline of `baselines.BASELINES` that fits the budgets) and
`better_of` (the solver's plan, or the start when the solver's plan evaluates slower: a solve never returns worse
than where it started). Plans are compared by `stages.evaluate_plan`, the MILP's own objective (the start reaches
HiGHS through `highs_start.highs_command`). Imports neither pulp nor torch, and knows neither the formulation's
variables nor the runtime.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .baselines import BASELINES, baseline_plan
from .costmodel import CostModel
from .plan import Plan
from .stages import _fits, evaluate_plan


def start_candidates(
    cm: CostModel,
    gpu_budget: int,
    host_budget: int,
    nvme_budget: int,
    allowed_tiers: Sequence[str],
    plans: Sequence[Plan | None] = (),
) -> list[Plan]:
    """The plans a solve of ``cm`` may start from, fastest first (by `evaluate_plan`, with the optimizer overlapping
    the next forward as in every MILP plan): ``plans`` (the caller's warm start, the coarse solve, the heuristic)
    and the baselines of `BASELINES`, each kept only when it has the model's layers and fits the budgets using the
    allowed tiers only. The first one the model accepts is its warm start."""
    out: list[tuple[float, int, Plan]] = []
    cands = [p for p in plans if p is not None]
    for name in BASELINES:
        cands.append(baseline_plan(name, cm))
    for n, plan in enumerate(cands):
        if plan.num_layers != cm.num_layers or not plan.tiers_used() <= set(allowed_tiers):
            continue
        plan = Plan.from_dict(plan.to_dict())
        plan.optimizer_overlap = True
        plan.micro_batch_size, plan.seq_len = cm.micro_batch_size, cm.seq_len
        ev = evaluate_plan(plan, cm)
        if _fits(ev, gpu_budget, host_budget, nvme_budget):
            out.append((ev.step_time_s, n, plan))
    out.sort(key=lambda t: (t[0], t[1]))
    return [p for _, _, p in out]


def better_of(plan: Plan, start: Plan | None, cm: CostModel) -> tuple[Plan, bool]:
    """``(plan, False)``, or ``(start, True)`` when ``start`` evaluates faster than the solver's ``plan``.

    Note: [A solve never returns worse than its start]
    The start is a point of the model and the objective is `evaluate_plan`'s step time, so a solver that received
    the start returns at most its objective; a solver stopped early or at its gap tolerance after a start that
    did not reach it could return worse. Either way the start is kept then, and the caller says so.
    """
    if start is None:
        return plan, False
    t_plan = evaluate_plan(plan, cm).step_time_s
    t_start = evaluate_plan(start, cm).step_time_s
    if t_start < t_plan * (1 - 1e-12) and not math.isclose(t_start, t_plan, rel_tol=1e-12):
        return start, True
    return plan, False
