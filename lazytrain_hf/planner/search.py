"""Searches over the micro-batch size: the largest batch that fits, and the fastest plan among a few batch sizes.

Owns: `max_feasible_batch` (doubling then bisection over a monotone feasibility test), `batch_candidates` (the
batch sizes the outer search solves at) and `fastest_plan` (solve each, largest first, warm-starting each from the
previous batch's plan; keep the highest predicted tokens/s). The feasibility test and the per-batch solve are
passed in, so the same searches serve the MILP (`milp.plan_for_model`, `lazytrain plan`) and the baselines. Does
not build or solve a MILP itself, imports neither pulp nor torch, and does not know the runtime.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

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
