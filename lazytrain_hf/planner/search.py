"""Searches over the micro-batch size: the largest batch that fits, and the fastest plan among a few batch sizes.

Owns: `max_feasible_batch` (doubling then bisection over a monotone feasibility test), `batch_candidates` (the
batch sizes the outer search solves at) and `fastest_plan` (solve each, largest first, warm-starting each from the
previous batch's plan; keep the highest predicted tokens/s), and `fastest_plan_bounded`, the same within a
wall-clock budget, leaving out every batch size whose upper bound of tokens/s cannot beat the plan held (Note:
[The batch search solves only the batch sizes that can win]). The feasibility test and the per-batch solve are
passed in, so the same searches serve the MILP (`milp.plan_for_model`, `lazytrain plan`) and the baselines. Does
not build or solve a MILP itself, imports neither pulp nor torch, and does not know the runtime.

Note: [The batch search solves only the batch sizes that can win]
    A plan at batch ``b`` runs at ``b * T / step`` tokens/s, and no plan's step is shorter than the optimum of the
    LP relaxation of the MILP at ``b``; so ``b * T / LP(b)`` bounds the tokens/s of every plan at ``b``, and a batch
    size whose bound is no higher than the tokens/s of the plan held cannot win: it is not solved. The LP takes
    0.1-0.3 s where a MILP solve takes 1-10 s, and its bound is tight on the planner's models (94-layer
    Qwen3-235B shape, seq 8192, h200: within 0.3-6% of the optimum at batch 1-24), so after the solve at the
    largest feasible batch usually every other batch size is left out. Solving every candidate with an even share
    of the search budget instead left three solves at their limit at gaps of 1.3-4.6% and the last solve with too
    little time under load (its plan the heuristic fallback). The same bound, of the least-memory model, proves a
    batch size infeasible without a MILP solve (`milp.milp_feasible`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from .plan import Plan


def max_feasible_batch(feasible: Callable[[int], bool], max_batch_size: int) -> int:
    """Largest ``b`` in ``[1, max_batch_size]`` with ``feasible(b)`` (monotone), or 0 when even 1 fails."""
    if not feasible(1):
        return 0
    lo, hi = 1, 1
    while hi < max_batch_size:
        nxt = min(max_batch_size, hi * 2)
        if feasible(nxt):
            lo = hi = nxt
        else:
            hi = nxt
            break
    if lo == hi:
        return lo
    while hi - lo > 1:  # lo feasible, hi infeasible
        mid = (lo + hi) // 2
        if feasible(mid):
            lo = mid
        else:
            hi = mid
    return lo


def batch_candidates(b_max: int) -> list[int]:
    """The batch sizes the outer search solves at: ``b_max``, 3/4 and 1/2 of it, and the powers of two below half
    (a larger batch is not always faster: offloading or recomputing more can cost more than the batch gains)."""
    return sorted(
        {b_max, max(1, (3 * b_max) // 4), max(1, b_max // 2)} | {2**k for k in range(8) if 2**k < b_max // 2}
    )


def fastest_plan(solve_at: Callable[[int, Plan | None], Plan], batch_sizes: Sequence[int]) -> Plan:
    """Solve at every batch size, largest first, ``solve_at(b, warm_start)`` warm-started from the previous batch's
    plan; return the plan with the highest predicted tokens/s (the larger batch among equals). Each solve's warnings
    are recorded and re-issued, every one of them."""
    if not batch_sizes:
        raise ValueError("batch_sizes is empty; pass at least one micro-batch size.")
    best: Plan | None = None
    prev: Plan | None = None
    for b in sorted(batch_sizes, reverse=True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = solve_at(b, _rescale(prev, b))
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        prev = plan
        if best is None or plan.predicted["tokens_per_s"] > best.predicted["tokens_per_s"]:
            best = plan
    return best


def _rescale(plan: Plan | None, b: int) -> Plan | None:
    """A copy of ``plan`` at micro-batch size ``b`` (decisions unchanged), as a warm start for the solve at ``b``."""
    if plan is None:
        return None
    out = Plan.from_dict(plan.to_dict())
    out.micro_batch_size = b
    return out


def fastest_plan_bounded(
    solve_at: Callable[[int, Plan | None, float], Plan],
    batch_sizes: Sequence[int],
    upper_bound: Callable[[int], float],
    seconds_left: Callable[[], float],
    min_solve_s: float,
) -> tuple[Plan, dict[str, Any]]:
    """The plan of highest predicted tokens/s over ``batch_sizes`` within a wall-clock budget (See Note: [The batch
    search solves only the batch sizes that can win]).

    Args:
        solve_at: ``solve_at(b, warm_start, seconds)`` solves at batch ``b`` within ``seconds``.
        upper_bound: ``upper_bound(b)``: tokens/s no plan at batch ``b`` exceeds (``math.inf``: unknown).
        seconds_left: the seconds left for solving (the caller keeps its own bookkeeping out of it).
        min_solve_s: a solve is not started with less time than this, once a plan is held.

    Returns:
        ``(plan, report)``, the report ``{"solved": [b...], "pruned": [[b, upper bound]...], "skipped": [b...],
        "fallback": [b...]}``: solved in that order, left out by their bound, left out for want of time, solved
        without a plan of the solver's (`outcome.settle`'s fallback). A fallback plan is returned only when no
        solve gave the solver's own plan.
    """
    if not batch_sizes:
        raise ValueError("batch_sizes is empty; pass at least one micro-batch size.")
    order = sorted(set(batch_sizes), reverse=True)
    best: Plan | None = None
    report: dict[str, Any] = {"solved": [], "pruned": [], "skipped": [], "fallback": []}
    for n, b in enumerate(order):
        if best is not None:
            if seconds_left() < min_solve_s:  # neither its bound nor its solve fits in what is left
                report["skipped"].append(b)
                continue
            bound = upper_bound(b)
            if bound <= best.predicted["tokens_per_s"]:
                report["pruned"].append([b, bound])
                continue
        left = seconds_left()
        if best is not None and left < min_solve_s:
            report["skipped"].append(b)
            continue
        # the first solve (the largest batch, most often the fastest) gets half of what is left: its plan is the
        # one the others' bounds are held against; the others share the rest evenly
        share = left / 2 if best is None and n + 1 < len(order) else left / (len(order) - n)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = solve_at(b, _rescale(best, b), max(share, min(min_solve_s, left)))
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        report["solved"].append(b)
        if plan.solver.get("fallback"):
            report["fallback"].append(b)
        if best is None or _better(plan, best):
            best = plan
    assert best is not None  # the first batch size is always solved
    return best, report


def _better(plan: Plan, than: Plan) -> bool:
    """Whether ``plan`` beats ``than``: a plan of the solver's (its gap known) beats a fallback, and then the
    higher predicted tokens/s wins."""
    mine, theirs = not plan.solver.get("fallback"), not than.solver.get("fallback")
    if mine != theirs:
        return mine
    return plan.predicted["tokens_per_s"] > than.predicted["tokens_per_s"]
