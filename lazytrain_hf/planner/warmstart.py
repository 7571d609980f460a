"""The start candidates the MILP is seeded with.

Owns: `start_candidates` (the plans a solve may start from, best first: the caller's warm start, the coarse
solve, the heuristic plan and every fixed baseline of `baselines.BASELINES` that fits the budgets). Plans are
compared by `stages.evaluate_plan`, the MILP's own objective; the best start reaches HiGHS through
`Highs.setSolution` (`highs_run.model_arrays`), and `outcome.settle` keeps the best of the solver's plan and every
candidate (Note: [A solve never returns worse than what it started from]). Imports neither pulp nor torch, and knows
neither the formulation's variables nor the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence

from .baselines import BASELINES, baseline_plan
from .costmodel import CostModel
from .plan import Plan
from .stages import evaluate_plan, fits_budgets


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
    and the baselines of `BASELINES`, each kept only when it has the model's layers, fits the budgets using the
    allowed tiers only and keeps no unit whose state is on NVMe resident (`CostModel.with_state_nvme`). The first one the model accepts is its warm start."""
    out: list[tuple[float, int, Plan]] = []
    cands = [p for p in plans if p is not None]
    for name in BASELINES:
        cands.append(baseline_plan(name, cm))
    for n, plan in enumerate(cands):
        if plan.num_layers != cm.num_layers or not plan.tiers_used() <= set(allowed_tiers):
            continue
        if any(lp.resident and lp.index in cm.state_nvme for lp in plan.layers):
            continue  # a unit whose state is on NVMe is never resident: not a point of the model
        plan = Plan.from_dict(plan.to_dict())
        plan.optimizer_overlap = True
        plan.stream_embeddings = cm.stream_embeddings  # the layers' decisions hold either way (the model's flag)
        plan.micro_batch_size, plan.seq_len = cm.micro_batch_size, cm.seq_len
        ev = evaluate_plan(plan, cm)
        if fits_budgets(ev, gpu_budget, host_budget, nvme_budget):
            out.append((ev.step_time_s, n, plan))
    out.sort(key=lambda t: (t[0], t[1]))
    return [p for _, _, p in out]
