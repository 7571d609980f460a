"""Plans made without a solver: the documented fallback `heuristic_plan` and the least-memory `min_memory_plan`.

Owns: the fixed rules that build a plan from the stage model alone. The heuristic plan is the MILP's warm start
and the plan `solve` uses (with a warning) when the solver returns none; the minimum-memory plan is the
heuristic's last resort and the fast path of `milp_feasible`. Every candidate is judged by `stages.evaluate_plan`,
never by a formula of its own. Imports neither pulp nor torch, and knows no solver and not the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence

from .costmodel import CostModel
from .formulation import BLOCK_SIZES
from .plan import Plan
from .stages import (
    DEFAULT_LOOKAHEAD,
    OPTIONS,
    Evaluation,
    evaluate_plan,
    fits_budgets,
    has_offloaded_bytes,
    layer_options,
    options_for_tiers,
    plan_from_options,
    reload_aheads,
)


def _legal_reload(L: int, i: int, option: str, lookahead: int) -> list[int]:
    if has_offloaded_bytes(option):
        return reload_aheads(L, i, option, lookahead)
    return [1]


def min_memory_plan(cm: CostModel, allowed_tiers: Sequence[str] = ("gpu", "cpu")) -> Plan:
    """A plan that keeps little on the device: every layer recomputed from an input parked off the device when a
    host tier is allowed, every transfer on demand, nothing resident; or, when the device tier is allowed and it
    peaks lower, block checkpointing with one layer's graph at a time (``block_graphs="layer"``) at the block size
    of `BLOCK_SIZES` that peaks lowest."""
    L = cm.num_layers
    allowed = options_for_tiers(allowed_tiers)
    options = []
    for i in range(L):
        legal = layer_options(L, i, allowed)
        options.append(next((o for o in ("rec_cpu", "rec_nvme", "rec_gpu") if o in legal), legal[0]))
    zeros = [0] * L
    best = plan_from_options(cm, options, fetch_fwd=zeros, fetch_bwd=zeros, reload=zeros, source="heuristic")
    if "rec_gpu" not in allowed:
        return best
    peak = evaluate_plan(best, cm).peak_gpu_bytes
    for K in BLOCK_SIZES:
        if K > L:
            break
        plan = plan_from_options(
            cm, ["rec_gpu"] * L, fetch_fwd=zeros, fetch_bwd=zeros, reload=zeros, source="heuristic",
            checkpoint_every=K, block_graphs="layer",
        )  # fmt: skip
        p = evaluate_plan(plan, cm).peak_gpu_bytes
        if p < peak:
            best, peak = plan, p
    return best


def heuristic_plan(
    cm: CostModel,
    gpu_budget: int,
    host_budget: int,
    nvme_budget: int = 0,
    allowed_tiers: Sequence[str] = ("gpu", "cpu"),
) -> Plan | None:
    """The documented fallback when no solver result exists (also the MILP's warm start).

    Start from every layer kept on the device with prefetch depth 1. While it does not fit, convert the first ``n``
    layers (their activations live longest) to one saving option: ``offload_cpu``, ``rec_cpu`` or ``rec_gpu``
    (smallest ``n`` that fits, by bisection), and take the fastest of those. Then make layers resident from the
    last one down (their backward fetch is saved) while the plan still fits and gets faster. ``None`` when even the
    minimum-memory plan does not fit.
    """
    L = cm.num_layers
    allowed = options_for_tiers(allowed_tiers)

    ff = [1] * L
    best: tuple[float, Plan] | None = None
    base = "keep" if "keep" in allowed else None
    candidates = [o for o in ("offload_cpu", "rec_cpu", "rec_gpu", "offload_nvme", "rec_nvme") if o in allowed]
    for saver in [None, *candidates]:
        if saver is None:
            if base is None:
                continue
            opts = [base] * L
            plan = plan_from_options(cm, opts, fetch_fwd=ff, source="heuristic")
            ev = evaluate_plan(plan, cm)
            if fits_budgets(ev, gpu_budget, host_budget, nvme_budget):
                best = (ev.step_time_s, plan)
                break
            continue

        def build(n: int, saver: str = saver) -> Plan:
            opts = []
            for i in range(L):
                o = saver if i < n else (base or saver)
                legal = layer_options(L, i, allowed)
                if o not in legal:  # the same policy on another tier, else what the layer can take
                    same = [x for x in legal if OPTIONS[x][0] == OPTIONS[o][0]]
                    o = base if base in legal else (same or legal)[0]
                opts.append(o)
            reload = [max(_legal_reload(L, i, opts[i], DEFAULT_LOOKAHEAD) or [0]) for i in range(L)]
            return plan_from_options(cm, opts, fetch_fwd=ff, reload=[min(1, r) for r in reload], source="heuristic")

        def ok(n: int) -> tuple[bool, Plan, Evaluation]:
            p = build(n)
            ev = evaluate_plan(p, cm)
            return fits_budgets(ev, gpu_budget, host_budget, nvme_budget), p, ev

        good, p, ev = ok(L)
        if not good:
            continue
        lo, hi = 0, L  # smallest n that fits is in (lo, hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid)[0]:
                hi = mid
            else:
                lo = mid
        _, p, ev = ok(hi)
        if best is None or ev.step_time_s < best[0]:
            best = (ev.step_time_s, p)
    if best is None:
        p = min_memory_plan(cm, allowed_tiers)
        ev = evaluate_plan(p, cm)
        if not fits_budgets(ev, gpu_budget, host_budget, nvme_budget):
            return None
        best = (ev.step_time_s, p)
    step, plan = best
    # Residency from the last layer down while it fits and helps.
    for i in reversed(range(L)):
        plan.layers[i].resident = True
        ev = evaluate_plan(plan, cm)
        if fits_budgets(ev, gpu_budget, host_budget, nvme_budget) and ev.step_time_s < step - 1e-12:
            step = ev.step_time_s
        else:
            plan.layers[i].resident = False
            break
    return plan
