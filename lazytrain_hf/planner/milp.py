"""Build and solve the LazyTrain MILP -> `Plan`: the planner's entry point (`plan_for_model`, `solve`).

Owns: `solve`, the pipeline for one cost model (budgets checked; the heuristic plan, or the MILP's least-memory
plan when that does not fit, as fallback and warm start; a lookahead-1 solve as a coarse warm start; the full
model solved; its plan extracted, or the fallback taken with a warning; predictions filled in by the exact stage
model), the least-memory solve behind `min_gpu_budget` / `milp_feasible` and `PlanInfeasibleError`, and
`plan_for_model` (config + hardware -> plan, with the outer batch search), which the trainer and the CLI call.
Each part of the MILP lives in its own module, and this one re-exports the names other code and tests use:

    stages.py       the stage model: per-layer options and slots, `evaluate_plan` (exact time and memory of a plan)
    heuristics.py   `heuristic_plan` (the documented fallback) and `min_memory_plan`
    formulation.py  the PuLP model: variables, `# [Constraint]` blocks, objective; warm start; plan extraction
    solver.py       the backend: CBC / HiGHS, time limit, gap, status read from the solver itself
    search.py       searches over the micro-batch size (largest feasible, fastest of a few)

Every solve of the planner calls the backend as this module's ``run_solver`` (tests replace it to play a failing
solver). Imports neither torch nor pulp itself and does not know the runtime: it returns a `Plan`, which the
trainer carries out.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from . import dpreduce
from .costmodel import CostModel
from .formulation import GIB, build_milp, extract_plan, set_warm_start
from .hardware import HardwareProfile, get_profile
from .heuristics import heuristic_plan, min_memory_plan
from .memmodel import with_accumulation, with_streamed_embeddings
from .outcome import PlannerFallbackWarning, settle
from .plan import Plan
from .search import batch_candidates, fastest_plan_bounded, max_feasible_batch
from .solver import SOLVERS, relaxation_bound, resolve_solver, run_solver
from .stages import (
    DEFAULT_LOOKAHEAD,
    OPTIONS,
    Evaluation,
    evaluate_plan,
    fetch_fwd_aheads,
    fits_budgets,
    has_offloaded_bytes,
    plan_from_options,
    reload_aheads,
)
from .warmstart import start_candidates
from .world import World
from .worldcost import for_world, record_world, world_host_state_bytes

__all__ = [
    # the entry points
    "PlanInfeasibleError",
    "PlannerFallbackWarning",
    "milp_feasible",
    "min_gpu_budget",
    "plan_for_model",
    "solve",
    # re-exported from the parts (see the module docstring)
    "DEFAULT_LOOKAHEAD",
    "OPTIONS",
    "SOLVERS",
    "Evaluation",
    "evaluate_plan",
    "heuristic_plan",
    "max_feasible_batch",
    "min_memory_plan",
    # stage-model and solver helpers that the tests reach through this module
    "fetch_fwd_aheads",
    "fits_budgets",
    "has_offloaded_bytes",
    "plan_from_options",
    "reload_aheads",
    "run_solver",
    # private helper that the CLI and the tests reach through this module
    "_resolve_config",
]


# ------------------------------------------------------------------------------------------------ solve
class PlanInfeasibleError(ValueError):
    """No plan fits the budgets. ``min_gpu_budget`` is the smallest GPU budget (bytes) with which one fits under the
    same host / NVMe budgets, or ``None`` when no GPU budget would do (the host or NVMe budget is the problem)."""

    def __init__(self, message: str, min_gpu_budget: int | None) -> None:
        super().__init__(message)
        self.min_gpu_budget = min_gpu_budget


def solve(
    cost_model: CostModel,
    gpu_budget: int | None = None,
    host_budget: int | None = None,
    nvme_budget: int = 0,
    allowed_tiers: Sequence[str] = ("gpu", "cpu"),
    time_limit: float = 30,
    gap: float = 0.01,
    solver: str = "auto",
    *,
    lookahead: int = DEFAULT_LOOKAHEAD,
    allow_resident: bool = True,
    fixed_slotting: bool = False,
    warm_start: Plan | None = None,
    threads: int | None = None,
) -> Plan:
    """Solve the MILP for ``cost_model`` and return the plan with ``predicted`` and ``solver`` filled in.

    Args:
        gpu_budget: device bytes the plan may use (default: the profile's memory minus 10%).
        host_budget: pinned host bytes for offloaded activations (default: half the host RAM).
        nvme_budget: NVMe bytes for spilled activations (0 disables the NVMe tier's use).
        allowed_tiers: where saved activations may live (``gpu``, ``cpu``, ``nvme``); recomputation is always
            allowed (its input then lives in one of these tiers).
        time_limit: solver seconds; on time-out the best incumbent is returned (with a warning), without one the
            heuristic plan.
        gap: relative MIP gap at which the solver stops.
        solver: ``"auto"`` (HiGHS when ``highspy`` is installed, else CBC), ``"cbc"`` or ``"highs"``.
        lookahead: ``D``, the most stages a transfer is issued ahead of its use.
        allow_resident: let the MILP keep layers' weights resident.
        fixed_slotting: fix every transfer to prefetch depth 1 (only policies and residency are decided).
        warm_start: a plan to start from (e.g. the previous batch size's); the heuristic plan otherwise.

    Raises:
        PlanInfeasibleError: no plan fits; ``min_gpu_budget`` says the smallest GPU budget that works.
    """
    cm = cost_model
    hw = cm.hardware
    gpu_budget = hw.default_gpu_budget() if gpu_budget is None else _check_budget(gpu_budget, "gpu_budget")
    host_budget = hw.default_host_budget() if host_budget is None else _check_budget(host_budget, "host_budget", 0)
    nvme_budget = _check_budget(nvme_budget, "nvme_budget", 0)
    if time_limit <= 0:
        raise ValueError(f"time_limit={time_limit} must be > 0 seconds (e.g. 30).")
    if not 0 <= gap < 1:
        raise ValueError(f"gap={gap} must be in [0, 1) (e.g. 0.01).")
    if lookahead < 0:
        raise ValueError(f"lookahead={lookahead} must be >= 0 (2 is the default).")
    allowed_tiers = _usable_tiers(allowed_tiers, nvme_budget)
    name = resolve_solver(solver)
    t_start = time.perf_counter()  # every solver call below shares the one time limit
    heuristic = heuristic_plan(cm, gpu_budget, host_budget, nvme_budget, allowed_tiers)
    if heuristic is None:
        # The simple schedules do not fit; the least-memory plan of the MILP decides (and is the fallback).
        heuristic = _min_memory_solution(
            cm, host_budget, nvme_budget, allowed_tiers, lookahead, solver, time_limit / 4, threads
        )
        if heuristic is None or not fits_budgets(evaluate_plan(heuristic, cm), gpu_budget, host_budget, nvme_budget):
            raise _infeasible(cm, gpu_budget, host_budget, nvme_budget, allowed_tiers, lookahead, solver)
    coarse = None
    # the coarse solve only when its share is worth a solver start (a heuristic slowed down by a loaded machine can
    # take the whole limit: its share would be negative)
    if lookahead >= 2 and not fixed_slotting and (time_limit - _since(t_start)) / 4 >= _MIN_SOLVE_S:
        # Solve with lookahead 1 first (a much smaller model): its plan is a point of this one and a strong warm start.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            coarse = solve(
                cm, gpu_budget, host_budget, nvme_budget, allowed_tiers, (time_limit - _since(t_start)) / 4, gap,
                solver,
                lookahead=1, allow_resident=allow_resident, warm_start=warm_start, threads=threads,
            )  # fmt: skip
        if coarse.source != "milp":
            coarse = None
    model = build_milp(
        cm, gpu_budget, host_budget, nvme_budget, allowed_tiers, lookahead, "time", allow_resident, fixed_slotting
    )
    # the fastest plan we hold that fits (caller's, coarse, heuristic, every baseline) and is a point of the model
    start = None
    candidates = start_candidates(
        cm, gpu_budget, host_budget, nvme_budget, allowed_tiers, (warm_start, coarse, heuristic)
    )
    start = next((c for c in candidates if set_warm_start(model, c, lookahead, cm)), None)
    remaining = time_limit - _since(t_start)
    if remaining >= _MIN_SOLVE_S:
        rep = run_solver(model.prob, name, remaining, gap, warm=start is not None, threads=threads)
    else:  # the earlier solves took the time: what they found is the answer (said so by `settle`)
        rep = {"status": "no_solution", "has_solution": False, "solver_result": "no time left for the full model"}
    rep["seconds"] = _since(t_start)
    if rep["status"] == "infeasible" and start is None:
        raise _infeasible(cm, gpu_budget, host_budget, nvme_budget, allowed_tiers, lookahead, solver)
    if rep["status"] == "infeasible":
        # A plan we hold fits by exact evaluation, so this is the solver's tolerance at a budget met with equality.
        rep["has_solution"] = False
    # Note: [A solve never returns worse than what it started from] (outcome.py): every candidate fits, and the
    # baselines are among them (`warmstart.start_candidates`)
    plan = settle(
        extract_plan(model, cm, "milp") if rep["has_solution"] else None, rep, candidates, cm, name, time_limit
    )
    plan.solver["lookahead"] = 1 if fixed_slotting else lookahead
    plan.solver["start"] = start.source if start is not None else None
    return plan


_MIN_SOLVE_S = 0.5  # the least time worth starting a solver for (a HiGHS worker process starts in ~0.3 s)
_LP_S = 5.0  # the most seconds of one LP relaxation (they take 0.1-0.3 s)
_LP_TOL = 1e-6  # relative: an LP bound must exceed the budget / plan by more than the LP's tolerances
_SEARCH_SOLVES_SHARE = 0.9  # of search_time_limit, for the search's probes and solves; the rest: bookkeeping
_MIN_SEARCH_SOLVE_S = 5.0  # the least time a batch search starts one more solve with (a loaded machine: 2-3 s)


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def _usable_tiers(tiers: Sequence[str], nvme_budget: int) -> tuple[str, ...]:
    """``tiers`` without nvme when there is no NVMe space (the tier cannot be used); ValueError when none is left."""
    tiers = tuple(tiers)
    if "nvme" in tiers and nvme_budget == 0:
        tiers = tuple(t for t in tiers if t != "nvme")
        if not tiers:
            raise ValueError(
                "allowed_tiers=('nvme',) with nvme_budget=0: the only tier has no space; pass an nvme_budget (e.g. "
                "'100GiB', `lazytrain plan --nvme-budget 100GiB`) or allow 'cpu' or 'gpu' too."
            )
    return tiers


def _check_budget(value: Any, option: str, minimum: int = 1) -> int:
    from ..units import parse_bytes

    if isinstance(value, int) and not isinstance(value, bool) and value == 0 and minimum == 0:
        return 0
    n = parse_bytes(value, option)
    if n is None or n < minimum:
        raise ValueError(f"{option}={value!r} must be a byte size >= {minimum} (e.g. '70GiB').")
    return n


# ------------------------------------------------------------------------------------------------ least memory
def min_gpu_budget(
    cm: CostModel,
    host_budget: int,
    nvme_budget: int = 0,
    allowed_tiers: Sequence[str] = ("gpu", "cpu"),
    lookahead: int = DEFAULT_LOOKAHEAD,
    solver: str = "auto",
    time_limit: float = 30,
) -> int | None:
    """Smallest peak device bytes over all plans within the host / NVMe budgets (``None``: no plan at all)."""
    plan = _min_memory_solution(cm, host_budget, nvme_budget, allowed_tiers, lookahead, solver, time_limit)
    # the exact peak of the extracted plan (integral bytes); the solver's bound only confirms optimality
    return None if plan is None else evaluate_plan(plan, cm).peak_gpu_bytes


def _min_memory_solution(
    cm: CostModel,
    host_budget: int,
    nvme_budget: int,
    allowed_tiers: Sequence[str],
    lookahead: int,
    solver: str,
    time_limit: float = 30,
    threads: int | None = None,
) -> Plan | None:
    """The plan of least peak device memory within the host / NVMe budgets (``None``: the solver found none)."""
    model = build_milp(cm, None, host_budget, nvme_budget, allowed_tiers, lookahead, objective="memory")
    rep = run_solver(model.prob, resolve_solver(solver), time_limit, 0.0, warm=False, threads=threads)
    if not rep["has_solution"]:
        return None
    return extract_plan(model, cm, "heuristic")


def _infeasible(
    cm: CostModel,
    gpu_budget: int,
    host_budget: int,
    nvme_budget: int,
    allowed_tiers: Sequence[str],
    lookahead: int,
    solver: str,
) -> PlanInfeasibleError:
    """The error for budgets no plan fits, naming the smallest GPU budget that works (or that none does)."""
    from ..units import format_bytes

    need = min_gpu_budget(cm, host_budget, nvme_budget, allowed_tiers, lookahead, solver)
    if need is None:
        return PlanInfeasibleError(
            f"no plan fits for micro_batch_size={cm.micro_batch_size}, seq_len={cm.seq_len}: with "
            f"allowed_tiers={tuple(allowed_tiers)}, host_budget={format_bytes(host_budget)} and "
            f"nvme_budget={format_bytes(nvme_budget)} no GPU budget is enough; allow the 'gpu' tier or raise the "
            "host budget.",
            None,
        )
    return PlanInfeasibleError(
        f"no plan fits gpu_budget={format_bytes(gpu_budget)} ({gpu_budget} B) for {cm.model_name or 'the model'} at "
        f"micro_batch_size={cm.micro_batch_size}, seq_len={cm.seq_len}; the smallest GPU budget that works is "
        f"min_gpu_budget={format_bytes(need)} ({need} B). Raise the budget, lower the batch size or sequence length, "
        "or allow more tiers.",
        need,
    )


def milp_feasible(
    cm: CostModel,
    gpu_budget: int,
    host_budget: int,
    nvme_budget: int = 0,
    allowed_tiers: Sequence[str] = ("gpu", "cpu"),
    lookahead: int = DEFAULT_LOOKAHEAD,
    solver: str = "auto",
    time_limit: float = 30,
) -> bool:
    """Whether any plan of the MILP fits the budgets (fast path: the minimum-memory schedule fits)."""
    quick = evaluate_plan(min_memory_plan(cm, allowed_tiers), cm)
    if fits_budgets(quick, gpu_budget, host_budget, nvme_budget):
        return True
    # the least-memory LP's optimum bounds every plan's peak from below (See Note: [The batch search solves only the
    # batch sizes that can win] in search.py): above the budget, no plan fits
    model = build_milp(cm, None, host_budget, nvme_budget, allowed_tiers, lookahead, objective="memory")
    least = relaxation_bound(model.prob, resolve_solver(solver), min(time_limit, _LP_S))
    if least is not None and least > gpu_budget / GIB * (1 + _LP_TOL):
        return False
    need = min_gpu_budget(cm, host_budget, nvme_budget, allowed_tiers, lookahead, solver, time_limit)
    return need is not None and need <= gpu_budget


# ------------------------------------------------------------------------------------------------ entry point
def better_of_embeddings(plan_with: Callable[[bool], Plan]) -> Plan:
    """The better of ``plan_with(False)`` (resident embedding and head) and ``plan_with(True)`` (streamed): the higher
    predicted tokens/s, resident on a tie; the one that fits where only one does (`plan_for_model`, the planner
    benchmark)."""
    plans, errors = [], []
    for on in (False, True):
        try:
            plans.append(plan_with(on))
        except PlanInfeasibleError as e:
            errors.append(e)
    if not plans:
        e = errors[-1]
        raise PlanInfeasibleError(f"{e} (with the embedding and head streamed too)", e.min_gpu_budget) from e
    return max(plans, key=lambda p: p.predicted["tokens_per_s"])  # max keeps the first (resident) on a tie


def _resolve_config(config: Any) -> tuple[Any, str]:
    """``(model config, model name)`` of an HF config (or a model holding one), a zoo name or a config path."""
    from .zoo import ZooConfig, load_config

    if isinstance(config, str):
        cfg = load_config(config)
        return cfg, getattr(cfg, "name", None) or config
    if isinstance(config, ZooConfig):
        return config, config.name
    cfg = getattr(config, "config", config)
    if not hasattr(cfg, "model_type"):
        raise TypeError(f"config={config!r} is not a model config; pass an HF config, a zoo name or a config path.")
    return cfg, getattr(cfg, "_name_or_path", "") or cfg.model_type


def plan_for_model(
    config: Any,
    hardware: HardwareProfile | str,
    seq_len: int,
    micro_batch_size: int | None = None,
    auto_batch_size: bool = False,
    gpu_budget: int | str | None = None,
    host_budget: int | str | None = None,
    nvme_budget: int | str = 0,
    allowed_tiers: Sequence[str] = ("gpu", "cpu"),
    *,
    max_batch_size: int = 256,
    time_limit: float = 30,
    gap: float = 0.01,
    solver: str = "auto",
    dtype_bytes: int = 2,
    loss_chunk_tokens: int = 1024,
    attn_implementation: str = "sdpa",
    measured_times: tuple[Sequence[float], Sequence[float]] | None = None,
    lookahead: int = DEFAULT_LOOKAHEAD,
    state_nvme: Sequence[int] = (),
    search_time_limit: float = 60,
    world: World | None = None,
    gradient_accumulation_steps: int = 1,
    stream_embeddings: bool | None = False,
) -> Plan:
    """Plan training of ``config`` on ``hardware`` (the entry point the trainer uses).

    Args:
        config: an HF config, a zoo name (``qwen2.5-7b``, ...) or a path to a ``config.json``.
        micro_batch_size: fixed batch (default 1); ignored with ``auto_batch_size``.
        auto_batch_size: search the micro-batch size with the highest predicted tokens/s; the largest feasible batch
            is recorded in ``plan.predicted["max_batch_size"]``.
        measured_times: ``(fwd_s, bwd_s)`` per layer measured at ``micro_batch_size`` (timed warm-up steps).
        time_limit: seconds of one solve (the batch search's solves share ``search_time_limit``).
        search_time_limit: with ``auto_batch_size``, the wall-clock seconds of the whole batch search: the largest
            feasible batch is solved first with half of what is left, and only the batch sizes that can beat the
            plan held are solved after it (`search.fastest_plan_bounded`); ``plan.predicted["batch_search"]`` says
            which were solved, left out by their bound or left out for want of time.
        state_nvme: the units whose training state is on NVMe (`lazytrain_hf.planner.hostmem.place_state`): their
            state I/O is in the stage and tail constraints (`CostModel.with_state_nvme`), and the plan keeps them.
        world: the data-parallel world every rank runs the plan in (`lazytrain_hf.planner.world`; default one
            rank): the MILP plans with a rank's optimizer times (`worldcost.for_world`), ``host_budget`` is then
            each rank's pinned activation budget (`hostmem.rank_activation_budget` of the node's), and the plan
            records the world, where its gradients are reduced (``dp_reduce``: `dpreduce.decide`, the shorter
            simulated step) and rank 0's ``bytes_per_step``.
        gradient_accumulation_steps: micro-batches per optimizer step: the resident gradients held through them
            (`memmodel.carried_grad_bytes`), the world's decision of how often the gradients are reduced
            (``dp_reduce_every``, `dpreduce.decide`) and its ``bytes_per_step``.
        stream_embeddings: plan with the embedding and head streamed (True, ``Plan.stream_embeddings``), resident
            (False), or ``None``: plan both (each with the full time limits) and keep the one with the higher
            predicted tokens/s (resident on a tie; the one that fits where only one does). Streaming frees their
            weights and held gradients on the device (`memmodel.streamed_head_terms`): 7.1 GiB for Qwen3.6-27B.
    """
    if stream_embeddings is None:
        args = dict(locals())
        del args["stream_embeddings"]
        return better_of_embeddings(lambda on: plan_for_model(**args, stream_embeddings=on))
    t_search = time.perf_counter()  # loading the config (transformers' config classes) counts too
    cfg, name = _resolve_config(config)
    hw = get_profile(hardware)
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size} must be >= 1.")
    if search_time_limit <= 0:
        raise ValueError(f"search_time_limit={search_time_limit} must be > 0 seconds (e.g. 60).")
    gpu_b = hw.default_gpu_budget() if gpu_budget is None else _check_budget(gpu_budget, "gpu_budget")
    host_b = hw.default_host_budget() if host_budget is None else _check_budget(host_budget, "host_budget", 0)
    nvme_b = _check_budget(nvme_budget, "nvme_budget", 0)
    tiers = _usable_tiers(allowed_tiers, nvme_b)
    b0 = micro_batch_size or 1
    base = CostModel.from_config(
        cfg,
        hw,
        seq_len,
        b0,
        dtype_bytes,
        loss_chunk_tokens=loss_chunk_tokens,
        attn_implementation=attn_implementation,
        model_name=name,
    )
    if measured_times is not None:
        base = base.with_measured_times(list(measured_times[0]), list(measured_times[1]))
    if state_nvme:
        base = base.with_state_nvme(state_nvme)
    base = with_streamed_embeddings(base, stream_embeddings)
    base = for_world(with_accumulation(base, gradient_accumulation_steps), world)
    host_state = base.host_state_bytes if world is None else world_host_state_bytes(base, world)
    if host_state > hw.host_memory_bytes:
        warnings.warn(
            f"{name}: the host model state ({host_state / 2**30:.0f} GiB: fp32 master, grads, 8-bit "
            f"moments{', per node' if world is not None and world.world_size > 1 else ''}) exceeds hardware "
            f"{hw.name}'s host memory ({hw.host_memory_bytes / 2**30:.0f} GiB).",
            stacklevel=2,
        )
    kw = dict(
        gpu_budget=gpu_b,
        host_budget=host_b,
        nvme_budget=nvme_b,
        allowed_tiers=tiers,
        time_limit=time_limit,
        gap=gap,
        solver=solver,
        lookahead=lookahead,
    )
    if not auto_batch_size:
        plan = solve(base, **kw)
        plan.model = name
        plan.state_nvme = sorted(int(k) for k in state_nvme)
        ga = gradient_accumulation_steps
        return record_world(dpreduce.decide(plan, base, world, ga), base, world, ga)

    cms: dict[int, CostModel] = {}
    # the probes and the solves end by this deadline; the rest of search_time_limit is for the bookkeeping between
    # and after them (building models, evaluating plans), which a loaded machine slows down too
    deadline = t_search + _SEARCH_SOLVES_SHARE * search_time_limit

    def cm_at(b: int) -> CostModel:
        if b not in cms:
            cms[b] = base.with_batch(b) if b != b0 else base
        return cms[b]

    def left() -> float:
        return deadline - time.perf_counter()

    def feasible(b: int) -> bool:
        return milp_feasible(cm_at(b), gpu_b, host_b, nvme_b, tiers, lookahead, solver, time_limit=max(left() / 4, 1))

    b_max = max_feasible_batch(feasible, max_batch_size)
    if b_max == 0:
        raise _infeasible(cm_at(1), gpu_b, host_b, nvme_b, tiers, lookahead, solver)

    def bound(b: int) -> float:
        # no plan at b beats b * T / LP(b) tokens/s (See Note: [The batch search solves only the batch sizes that
        # can win] in search.py)
        cm = cm_at(b)
        model = build_milp(cm, gpu_b, host_b, nvme_b, tiers, lookahead, "time")
        step = relaxation_bound(model.prob, resolve_solver(solver), min(max(left() / 4, 0.5), _LP_S))
        return cm.tokens / (step * (1 - _LP_TOL)) if step is not None and step > 0 else float("inf")

    def solve_at(b: int, warm: Plan | None, seconds: float) -> Plan:
        return solve(cm_at(b), **{**kw, "time_limit": max(min(time_limit, seconds), 1e-3)}, warm_start=warm)

    best, report = fastest_plan_bounded(solve_at, batch_candidates(b_max), bound, left, _MIN_SEARCH_SOLVE_S)
    best.predicted["max_batch_size"] = b_max
    best.predicted["batch_sizes_tried"] = report["solved"]
    best.predicted["batch_search"] = {**report, "candidates": batch_candidates(b_max), "seconds": _since(t_search)}
    best.model = name
    best.state_nvme = sorted(int(k) for k in state_nvme)
    cm = cm_at(best.micro_batch_size)
    ga = gradient_accumulation_steps
    return record_world(dpreduce.decide(best, cm, world, ga), cm, world, ga)
