"""The LazyTrain MILP: per-layer activation policy, weight residency and transfer slotting that minimise step time.

Stage model (shared by the MILP, `evaluate_plan` and the brute-force tests; the simulator in `simulate.py` is the
independent referee). A step is the stages ``s = 0 .. 2L``: ``F_i = i``, ``H = L``, ``B_i = 2L - i``, then a tail
``tail`` between the end of ``B_0`` and the start of the next step's ``F_0``. Within a stage the lanes overlap:

    T_s >= ondemand_h2d_s / BW_h2d + compute_s      (a transfer issued in the stage that needs it is waited for)
    T_s >= h2d_s / BW_h2d,   T_s >= d2h_s / BW_d2h,   T_s >= nvme_read_s / BW_nvme_r + nvme_write_s / BW_nvme_w

- ``compute``: ``f_i`` at ``F_i``, head fwd+bwd at ``H``, ``k_i`` (+ ``f_i`` when recomputed) at ``B_i``;
- ``h2d`` issued at ``s``: weight fetch of ``F_i`` at ``i - aF_i`` (``aF_0 = 1``: issued in the previous tail),
  of ``B_i`` at ``2L - i - aB_i``, activation reloads at ``2L - i - aR_i``, the lm_head upload at ``F_{L-1}``;
- ``d2h``: the offload of ``F_i``'s saved tensors at ``F_{i+1}``, the gradients of ``B_i`` at the next stage;
- NVMe: the write one stage after its D2H, the read one stage before its H2D reload.

Memory at every stage counts what is allocated from a transfer's issue stage to the end of its last use. The tail
holds the D2H of the last gradients, the CPU optimizer in layer order (``c_i`` = time from the end of ``B_0`` until
layer ``i`` is updated) and the embedding upload; with the optimizer overlapping the next forward, a fetch issued at
stage ``sigma`` must wait for its update: ``T_tail + sum_{j < sigma} T_j >= c_i``.

Minimising ``sum_s T_s + T_tail`` gives the steady-state step time (`evaluate_plan` computes the same number for a
fixed plan: every ``T_s`` at its lane bound, ``T_tail`` at the largest release it must cover).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .costmodel import CostModel
from .hardware import HardwareProfile, get_profile
from .plan import INPUT_TIERS, LayerPlan, Plan, PlanError

SOLVERS = ("auto", "cbc", "highs")
GIB = 2**30
DEFAULT_LOOKAHEAD = 2  # D: a transfer is issued at most D stages before the stage that needs it
# Options per layer: (policy, input tier of what the layer leaves behind, what is reloaded).
OPTIONS: dict[str, tuple[str, str]] = {
    "keep": ("keep", "gpu"),
    "offload_cpu": ("offload_cpu", "cpu"),
    "offload_nvme": ("offload_nvme", "nvme"),
    "rec_gpu": ("recompute", "gpu"),
    "rec_cpu": ("recompute", "cpu"),
    "rec_nvme": ("recompute", "nvme"),
}


class PlanInfeasibleError(ValueError):
    """No plan fits the budgets. ``min_gpu_budget`` is the smallest GPU budget (bytes) with which one fits under the
    same host / NVMe budgets, or ``None`` when no GPU budget would do (the host or NVMe budget is the problem)."""

    def __init__(self, message: str, min_gpu_budget: int | None) -> None:
        super().__init__(message)
        self.min_gpu_budget = min_gpu_budget


# ------------------------------------------------------------------------------------------------ helpers
def _option_of(lp: LayerPlan) -> str:
    if lp.policy == "recompute":
        return {"gpu": "rec_gpu", "cpu": "rec_cpu", "nvme": "rec_nvme"}[lp.input_tier]
    return lp.policy


def _offloaded_bytes(cm: CostModel, i: int, option: str) -> int:
    """Bytes of layer i that leave the device after its forward and come back before its backward."""
    lc = cm.layers[i]
    if option in ("offload_cpu", "offload_nvme"):
        return lc.saved_bytes
    if option in ("rec_cpu", "rec_nvme"):
        return lc.input_bytes
    return 0


def _reload_stages(L: int, i: int, option: str, lookahead: int) -> list[int]:
    """Allowed ahead-values ``a`` of the reload for ``B_i``: after the offload (cpu: D2H at F_{i+1}; nvme: write at
    F_{i+2}, read one stage before the H2D)."""
    sB = 2 * L - i
    tier = OPTIONS[option][1]
    earliest = i + 2 if tier == "cpu" else i + 4
    return [a for a in range(lookahead + 1) if sB - a >= earliest]


def _fetch_fwd_aheads(i: int, lookahead: int, prestep: bool = True) -> list[int]:
    # F_0's fetch may be issued in the previous step's tail (ahead 1); later layers only inside the step.
    if i == 0:
        return [0, 1] if prestep and lookahead >= 1 else [0]
    return list(range(min(lookahead, i) + 1))


# ------------------------------------------------------------------------------------------------ evaluation
@dataclass
class Evaluation:
    """Stage-model evaluation of a fixed plan (what the MILP's objective and constraints say about it)."""

    step_time_s: float
    stage_times: list[float]
    tail_s: float
    stage_memory: list[int]  # per stage, then the tail
    peak_gpu_bytes: int
    pinned_host_bytes: int
    nvme_bytes: int
    peak_host_bytes: int
    tflops: float
    tokens_per_s: float

    def predictions(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "tflops": self.tflops,
            "tokens_per_s": self.tokens_per_s,
            "peak_gpu_bytes": self.peak_gpu_bytes,
            "peak_host_bytes": self.peak_host_bytes,
            "pinned_host_bytes": self.pinned_host_bytes,
            "nvme_bytes": self.nvme_bytes,
        }


def _optimizer_finish_times(cm: CostModel) -> tuple[float, list[float], float]:
    """When the CPU optimizer finishes, measured from the end of backward: the embedding (after the last gradients
    came down), each layer in order, then the head. Shared by `evaluate_plan` and the MILP's tail constraints."""
    L = cm.num_layers
    t_d2h = ((cm.layers[0].grad_bytes if L else 0) + cm.embed_grad_bytes) / cm.d2h
    c_emb = t_d2h + cm.embed_optimizer_s
    c, acc = [], c_emb
    for lc in cm.layers:
        acc += lc.optimizer_s
        c.append(acc)
    return c_emb, c, acc + cm.head_optimizer_s


def evaluate_plan(plan: Plan, cm: CostModel) -> Evaluation:
    """Step time, memory per stage and predictions of ``plan`` under the stage model (see module docstring)."""
    L = cm.num_layers
    plan.validate(L)
    S = 2 * L + 1
    Bh, Bd, Bnr, Bnw = cm.h2d, cm.d2h, cm.nvme_r, cm.nvme_w
    comp = [0.0] * S
    od = [0.0] * S  # on-demand H2D bytes (issued in the stage that needs them)
    h2d = [0.0] * S
    d2h = [0.0] * S
    nvr = [0.0] * S
    nvw = [0.0] * S
    mem_diff = [0] * (S + 1)
    mem_tail = 0
    pinned = 0
    nvme = 0

    def alive(lo: int, hi: int, nbytes: int) -> None:  # allocated at stages lo..hi inclusive
        mem_diff[lo] += nbytes
        mem_diff[hi + 1] -= nbytes

    K = plan.checkpoint_every
    release: list[tuple[int, float]] = []  # (issue stage, layer) of forward fetches that wait for the optimizer
    prestep: list[int] = []
    for lp in plan.layers:
        i = lp.index
        lc = cm.layers[i]
        sB = 2 * L - i
        option = _option_of(lp)
        # ---- forward weights
        sigma = i - lp.fetch_fwd_ahead
        if sigma < 0:
            prestep.append(i)
            if not lp.resident:
                alive(0, i, lc.weight_bytes)
                mem_tail += lc.weight_bytes
        else:
            h2d[sigma] += lc.weight_bytes
            if sigma == i:
                od[i] += lc.weight_bytes
            if not lp.resident:
                alive(sigma, i, lc.weight_bytes)
            release.append((sigma, i))
        comp[i] += lc.fwd_s
        # ---- backward weights
        if lp.resident:
            alive(0, S - 1, lc.weight_bytes)
            mem_tail += lc.weight_bytes
        else:
            sb = max(0, sB - lp.fetch_bwd_ahead)
            h2d[sb] += lc.weight_bytes
            if sb == sB:
                od[sB] += lc.weight_bytes
            alive(sb, sB, lc.weight_bytes)
        comp[sB] += lc.bwd_s
        # ---- saved activations
        off = _offloaded_bytes(cm, i, option)
        if K > 1:
            pass  # block checkpointing, handled below
        elif option == "keep":
            alive(i, sB, lc.saved_bytes)
        elif option == "rec_gpu":
            alive(i, sB, lc.input_bytes)
        else:
            alive(i, i + 1, lc.saved_bytes if option.startswith("offload") else lc.input_bytes)
            d2h[i + 1] += off
            tier = OPTIONS[option][1]
            ok = _reload_stages(L, i, option, 2 * L)
            if not ok:
                raise PlanError(f"layer {i}: {option} is impossible; its backward follows its forward too closely.")
            a = min(lp.reload_ahead, max(ok))  # clamp to the ordering: reload after offload
            sr = sB - a
            h2d[sr] += off
            if sr == sB:
                od[sB] += off
            alive(sr, sB, off)
            if tier == "cpu":
                pinned += off
            else:
                nvme += off
                nvw[i + 2] += off
                nvr[sr - 1] += off
        if K == 1 and option.startswith("rec"):
            comp[sB] += lc.fwd_s  # recomputation, and its activations live during B_i
            alive(sB, sB, lc.saved_bytes)
        # ---- working sets and gradients
        alive(i, i, lc.ws_fwd_bytes)
        alive(sB, sB, lc.ws_bwd_bytes)
        if i > 0:
            alive(sB, sB + 1, lc.grad_bytes)
            d2h[sB + 1] += lc.grad_bytes
        else:
            alive(sB, sB, lc.grad_bytes)
            mem_tail += lc.grad_bytes
    if K > 1:
        for j in range(0, L, K):
            block = list(range(j, min(j + K, L)))
            last = block[-1]
            s_rec = 2 * L - last
            alive(j, 2 * L - j, cm.layers[j].input_bytes)  # the block checkpoint
            comp[s_rec] += sum(cm.layers[k].fwd_s for k in block)
            h2d[s_rec] += sum(cm.layers[k].weight_bytes for k in block)
            od[s_rec] += cm.layers[j].weight_bytes  # the first recompute fetch has nothing to hide behind
            alive(s_rec, s_rec, 2 * max(cm.layers[k].weight_bytes for k in block))  # recompute double buffer
            for k in block:
                alive(s_rec, 2 * L - k, cm.layers[k].saved_bytes)
    # ---- head stage
    comp[L] += cm.head_s
    alive(L, L, cm.head_ws_bytes)
    alive(L, L + 1, cm.head_grad_bytes)
    d2h[L + 1] += cm.head_grad_bytes
    if cm.head_bytes and L >= 1:
        h2d[L - 1] += cm.head_bytes
    fixed = cm.fixed_device_bytes
    stage_times = [max(od[s] / Bh + comp[s], h2d[s] / Bh, d2h[s] / Bd, nvr[s] / Bnr + nvw[s] / Bnw) for s in range(S)]
    # ---- tail: last gradients down, optimizer in layer order, embedding (+ pre-step fetches) up
    c_emb, c, c_all = _optimizer_finish_times(cm)
    prefix = [0.0]
    for t in stage_times:
        prefix.append(prefix[-1] + t)
    if plan.optimizer_overlap:
        e = c_emb + cm.embed_bytes / Bh
        for i in sorted(prestep):
            e = max(e, c[i]) + cm.layers[i].weight_bytes / Bh
        tail = e
        for sigma, i in release:
            tail = max(tail, c[i] - prefix[sigma])
        if cm.head_bytes and L >= 1:
            tail = max(tail, c_all - prefix[L - 1])
    else:
        e = c_all + cm.embed_bytes / Bh
        for i in sorted(prestep):
            e += cm.layers[i].weight_bytes / Bh
        tail = e
    mem = []
    run = 0
    for s in range(S):
        run += mem_diff[s]
        mem.append(fixed + run)
    mem.append(fixed + mem_tail + cm.embed_grad_bytes)
    step = prefix[-1] + tail
    peak_gpu = max(mem)
    return Evaluation(
        step_time_s=step,
        stage_times=stage_times,
        tail_s=tail,
        stage_memory=mem,
        peak_gpu_bytes=int(peak_gpu),
        pinned_host_bytes=int(pinned),
        nvme_bytes=int(nvme),
        peak_host_bytes=int(cm.host_state_bytes + pinned),
        tflops=cm.model_flops / step / 1e12,
        tokens_per_s=cm.tokens / step,
    )


# ------------------------------------------------------------------------------------------------ plans
def _make_plan(
    cm: CostModel,
    options: Sequence[str],
    resident: Sequence[bool] | None = None,
    fetch_fwd: Sequence[int] | None = None,
    fetch_bwd: Sequence[int] | None = None,
    reload: Sequence[int] | None = None,
    **kwargs: Any,
) -> Plan:
    L = cm.num_layers
    layers = []
    for i in range(L):
        policy, tier = OPTIONS[options[i]]
        layers.append(
            LayerPlan(
                index=i,
                kind=cm.layers[i].kind,
                policy=policy,
                input_tier=tier if policy == "recompute" else "gpu",
                resident=bool(resident[i]) if resident is not None else False,
                fetch_fwd_ahead=fetch_fwd[i] if fetch_fwd is not None else 1,
                fetch_bwd_ahead=fetch_bwd[i] if fetch_bwd is not None else 1,
                reload_ahead=reload[i] if reload is not None else 1,
            )
        )
    kwargs.setdefault("loss_chunk_tokens", cm.loss_chunk_tokens)
    return Plan(
        layers=layers,
        micro_batch_size=cm.micro_batch_size,
        seq_len=cm.seq_len,
        hardware=cm.hardware.name,
        model=cm.model_name,
        **kwargs,
    )


def _allowed_options(allowed_tiers: Sequence[str]) -> list[str]:
    bad = [t for t in allowed_tiers if t not in INPUT_TIERS]
    if bad:
        raise ValueError(
            f"allowed_tiers={tuple(allowed_tiers)!r}: unknown tier {bad[0]!r}; allowed are {INPUT_TIERS}."
        )
    if not allowed_tiers:
        raise ValueError("allowed_tiers is empty; pass at least one of ('gpu', 'cpu', 'nvme').")
    return [o for o, (_, tier) in OPTIONS.items() if tier in allowed_tiers]


def _legal_reload(L: int, i: int, option: str, lookahead: int) -> list[int]:
    if _offloaded_bytes_needed(option):
        return _reload_stages(L, i, option, lookahead)
    return [1]


def _offloaded_bytes_needed(option: str) -> bool:
    return OPTIONS[option][1] != "gpu"


def min_memory_plan(cm: CostModel, allowed_tiers: Sequence[str] = ("gpu", "cpu")) -> Plan:
    """A plan that keeps little on the device: every layer recomputed from an input parked off the device when a
    host tier is allowed, every transfer on demand, nothing resident."""
    L = cm.num_layers
    allowed = _allowed_options(allowed_tiers)
    options = []
    for i in range(L):
        choice = next((o for o in ("rec_cpu", "rec_nvme") if o in allowed and _reload_stages(L, i, o, 0)), None)
        options.append(choice or ("rec_gpu" if "rec_gpu" in allowed else allowed[0]))
    zeros = [0] * L
    return _make_plan(cm, options, fetch_fwd=zeros, fetch_bwd=zeros, reload=zeros, source="heuristic")


def _fits(ev: Evaluation, gpu_budget: int, host_budget: int, nvme_budget: int) -> bool:
    return ev.peak_gpu_bytes <= gpu_budget and ev.pinned_host_bytes <= host_budget and ev.nvme_bytes <= nvme_budget


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
    allowed = _allowed_options(allowed_tiers)

    ff = [1] * L
    best: tuple[float, Plan] | None = None
    base = "keep" if "keep" in allowed else None
    candidates = [o for o in ("offload_cpu", "rec_cpu", "rec_gpu", "offload_nvme", "rec_nvme") if o in allowed]
    for saver in [None, *candidates]:
        if saver is None:
            if base is None:
                continue
            opts = [base] * L
            plan = _make_plan(cm, opts, fetch_fwd=ff, source="heuristic")
            ev = evaluate_plan(plan, cm)
            if _fits(ev, gpu_budget, host_budget, nvme_budget):
                best = (ev.step_time_s, plan)
                break
            continue

        def build(n: int, saver: str = saver) -> Plan:
            opts = []
            for i in range(L):
                o = saver if i < n else (base or saver)
                if _offloaded_bytes_needed(o) and not _reload_stages(L, i, o, 2 * L):
                    o = base or ("rec_gpu" if "rec_gpu" in allowed else o)
                opts.append(o)
            reload = [max(_legal_reload(L, i, opts[i], DEFAULT_LOOKAHEAD) or [0]) for i in range(L)]
            return _make_plan(cm, opts, fetch_fwd=ff, reload=[min(1, r) for r in reload], source="heuristic")

        def ok(n: int) -> tuple[bool, Plan, Evaluation]:
            p = build(n)
            ev = evaluate_plan(p, cm)
            return _fits(ev, gpu_budget, host_budget, nvme_budget), p, ev

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
        if not _fits(ev, gpu_budget, host_budget, nvme_budget):
            return None
        best = (ev.step_time_s, p)
    step, plan = best
    # Residency from the last layer down while it fits and helps.
    for i in reversed(range(L)):
        plan.layers[i].resident = True
        ev = evaluate_plan(plan, cm)
        if _fits(ev, gpu_budget, host_budget, nvme_budget) and ev.step_time_s < step - 1e-12:
            step = ev.step_time_s
        else:
            plan.layers[i].resident = False
            break
    return plan


# ------------------------------------------------------------------------------------------------ the MILP
@dataclass
class _Model:
    prob: Any
    opt: list[dict[str, Any]]  # per layer: option -> binary
    res: list[Any]
    yF: list[dict[int, tuple[Any, Any]]]  # per layer: ahead -> (streamed binary, resident binary)
    yB: list[dict[int, Any]]
    yR: list[dict[tuple[str, int], Any]]
    T: list[Any]
    T_tail: Any
    peak: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def _var(prob: Any, name: str, cat: str = "Binary") -> Any:
    """A variable attached to ``prob`` (PuLP >= 3.3 API, else the classic constructor); continuous ones are >= 0."""
    import pulp

    low = 0 if cat == "Continuous" else None
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound=low, cat=cat)
    return pulp.LpVariable(name, lowBound=low, cat=cat)


def _build(
    cm: CostModel,
    gpu_budget: int | None,
    host_budget: int,
    nvme_budget: int,
    allowed_tiers: Sequence[str],
    lookahead: int,
    objective: str,
    allow_resident: bool = True,
    fixed_slotting: bool = False,
) -> _Model:
    import pulp

    L = cm.num_layers
    S = 2 * L + 1
    Bh, Bd, Bnr, Bnw = cm.h2d, cm.d2h, cm.nvme_r, cm.nvme_w
    allowed = _allowed_options(allowed_tiers)
    prob = pulp.LpProblem("lazytrain_step_time" if objective == "time" else "lazytrain_min_memory", pulp.LpMinimize)

    # ------------------------------------------------------------------ decision variables
    opt: list[dict[str, Any]] = []  # opt[i][o] = 1: layer i uses option o (keep / offload_* / rec_<input tier>)
    res: list[Any] = []  # res[i] = 1: layer i's weights stay on the device all step (one upload per step)
    yF: list[dict[int, tuple[Any, Any]]] = []  # yF[i][a] = (streamed, resident): F_i's weights issued a stages ahead
    yB: list[dict[int, Any]] = []  # yB[i][a] = 1: B_i's weight fetch issued a stages before B_i
    yR: list[dict[tuple[str, int], Any]] = []  # yR[i][(o, a)] = 1: B_i's reload (option o) issued a stages ahead
    for i in range(L):
        layer_opts = {}
        for o in allowed:
            if _offloaded_bytes_needed(o) and not _reload_stages(L, i, o, lookahead):
                continue  # its backward follows too closely for this tier
            layer_opts[o] = _var(prob, f"opt_{i}_{o}")
        if not layer_opts:
            raise ValueError(f"allowed_tiers={tuple(allowed_tiers)!r} leave layer {i} no legal option.")
        opt.append(layer_opts)
        res.append(_var(prob, f"res_{i}") if allow_resident else None)
        yF.append(
            {
                a: (
                    _var(prob, f"yFs_{i}_{a}"),
                    _var(prob, f"yFr_{i}_{a}") if allow_resident else None,
                )
                for a in _fetch_fwd_aheads(i, lookahead)
                if not fixed_slotting or a == min(i, 1) or (i == 0 and a == 1)
            }
        )
        if fixed_slotting and i == 0 and 1 in yF[i]:
            yF[i] = {1: yF[i][1]}  # prefetch depth 1: F_0's fetch in the previous tail
        yB.append({a: _var(prob, f"yB_{i}_{a}") for a in range(lookahead + 1) if not fixed_slotting or a == 1})
        yR.append(
            {
                (o, a): _var(prob, f"yR_{i}_{o}_{a}")
                for o in layer_opts
                if _offloaded_bytes_needed(o)
                for a in _reload_stages(L, i, o, lookahead)
                if not fixed_slotting or a == min(1, max(_reload_stages(L, i, o, lookahead)))
            }
        )
    T = [_var(prob, f"T_{s}", "Continuous") for s in range(S)]  # T[s]: duration of stage s (seconds)
    T_tail = _var(prob, "T_tail", "Continuous")  # end of B_0 -> start of the next F_0 (seconds)
    model = _Model(prob, opt, res, yF, yB, yR, T, T_tail)

    # ------------------------------------------------------------------ [Constraint] one choice per decision
    for i in range(L):
        prob += pulp.lpSum(opt[i].values()) == 1, f"one_option_{i}"
        prob += pulp.lpSum(v for pair in yF[i].values() for v in pair if v is not None) == 1, f"one_fwd_fetch_{i}"
        if allow_resident:
            prob += pulp.lpSum(r for _, r in yF[i].values()) == res[i], f"resident_upload_{i}"
        prob += pulp.lpSum(yB[i].values()) == 1 - (res[i] if allow_resident else 0), f"bwd_fetch_unless_resident_{i}"
        for o in opt[i]:
            if _offloaded_bytes_needed(o):
                prob += pulp.lpSum(v for (oo, _), v in yR[i].items() if oo == o) == opt[i][o], f"one_reload_{i}_{o}"

    # ------------------------------------------------------------------ per-stage loads (linear expressions)
    comp = [[] for _ in range(S)]  # compute seconds
    od = [[] for _ in range(S)]  # on-demand H2D bytes
    h2d = [[] for _ in range(S)]
    d2h = [[] for _ in range(S)]
    nvr = [[] for _ in range(S)]
    nvw = [[] for _ in range(S)]
    mem = [[] for _ in range(S + 1)]  # index S: the tail
    const_comp = [0.0] * S
    const_h2d = [0.0] * S
    const_d2h = [0.0] * S
    const_mem = [0.0] * (S + 1)
    for i, lc in enumerate(cm.layers):
        sB = 2 * L - i
        w, A, x = lc.weight_bytes, lc.saved_bytes, lc.input_bytes
        const_comp[i] += lc.fwd_s
        const_comp[sB] += lc.bwd_s
        # forward fetch: slot memory from issue to F_i when streamed; resident weights counted below
        for a, (ys, yr) in yF[i].items():
            sigma = i - a
            if sigma < 0:  # issued in the previous tail
                for s in range(0, i + 1):
                    mem[s].append((w, ys))
                mem[S].append((w, ys))
                continue
            for y in (ys, yr):
                if y is not None:
                    h2d[sigma].append((w, y))
                    if a == 0:
                        od[i].append((w, y))
            for s in range(sigma, i + 1):
                mem[s].append((w, ys))
        # resident weights: all stages and the tail
        if allow_resident:
            for s in range(S + 1):
                mem[s].append((w, res[i]))
        # backward fetch
        for a, y in yB[i].items():
            sb = sB - a
            h2d[sb].append((w, y))
            if a == 0:
                od[sB].append((w, y))
            for s in range(sb, sB + 1):
                mem[s].append((w, y))
        # saved activations
        for o, v in opt[i].items():
            if o == "keep":
                for s in range(i, sB + 1):
                    mem[s].append((A, v))
            elif o == "rec_gpu":
                for s in range(i, sB + 1):
                    mem[s].append((x, v))
            else:
                off = A if o.startswith("offload") else x
                mem[i].append((off, v))
                mem[i + 1].append((off, v))
                d2h[i + 1].append((off, v))
                if OPTIONS[o][1] == "nvme":
                    nvw[i + 2].append((off, v))
            if o.startswith("rec"):
                comp[sB].append((lc.fwd_s, v))  # recomputation
                mem[sB].append((A, v))  # the recomputed activations during B_i
        for (o, a), y in yR[i].items():
            off = A if o.startswith("offload") else x
            sr = sB - a
            h2d[sr].append((off, y))
            if a == 0:
                od[sB].append((off, y))
            if OPTIONS[o][1] == "nvme":
                nvr[sr - 1].append((off, y))
            for s in range(sr, sB + 1):
                mem[s].append((off, y))
        # working sets and gradients
        const_mem[i] += lc.ws_fwd_bytes
        const_mem[sB] += lc.ws_bwd_bytes + lc.grad_bytes
        if i > 0:
            const_mem[sB + 1] += lc.grad_bytes
            const_d2h[sB + 1] += lc.grad_bytes
        else:
            const_mem[S] += lc.grad_bytes
    const_comp[L] += cm.head_s
    const_mem[L] += cm.head_ws_bytes + cm.head_grad_bytes
    const_mem[L + 1] += cm.head_grad_bytes
    const_d2h[L + 1] += cm.head_grad_bytes
    if cm.head_bytes and L >= 1:
        const_h2d[L - 1] += cm.head_bytes
    const_mem[S] += cm.embed_grad_bytes
    fixed = cm.fixed_device_bytes

    def expr(terms: list[tuple[float, Any]], scale: float = 1.0, const: float = 0.0):
        # Note: a variable may appear in several terms (e.g. a recomputed layer's input and its recomputed
        # activations at B_i); LpAffineExpression keeps only the last coefficient of a repeated key, so sum first.
        coef: dict[Any, float] = {}
        for c, v in terms:
            if v is not None:
                coef[v] = coef.get(v, 0.0) + c * scale
        return pulp.LpAffineExpression(list(coef.items()), constant=const * scale)

    # ------------------------------------------------------------------ [Constraint] lanes overlap within a stage
    for s in range(S):
        prob += T[s] >= expr(od[s], 1 / Bh) + expr(comp[s], 1.0, const_comp[s]), f"compute_after_ondemand_{s}"
        prob += T[s] >= expr(h2d[s], 1 / Bh, const_h2d[s]), f"h2d_lane_{s}"
        prob += T[s] >= expr(d2h[s], 1 / Bd, const_d2h[s]), f"d2h_lane_{s}"
        if nvr[s] or nvw[s]:
            prob += T[s] >= expr(nvr[s], 1 / Bnr) + expr(nvw[s], 1 / Bnw), f"nvme_lane_{s}"

    # ------------------------------------------------------------------ [Constraint] tail: optimizer and uploads
    c_emb, c, c_all = _optimizer_finish_times(cm)
    emb_up = c_emb + cm.embed_bytes / Bh
    prob += T_tail >= emb_up, "tail_embedding_upload"
    if L:
        ys, yr = yF[0][1] if 1 in yF[0] else (None, None)
        pre0 = [(1.0, ys), (1.0, yr)]
        prob += T_tail >= expr(pre0, max(emb_up, c[0]) + cm.layers[0].weight_bytes / Bh), "tail_prestep_fetch_0"
    # [Constraint] a fetch for the next forward waits for its layer's update (optimizer overlaps the next forward)
    for i in range(L):
        for a, (ys, yr) in yF[i].items():
            sigma = i - a
            if sigma < 0:
                continue
            prob += (
                T_tail + pulp.lpSum(T[:sigma]) >= expr([(1.0, ys), (1.0, yr)], c[i]),
                f"update_before_fetch_{i}_{a}",
            )
    if cm.head_bytes and L >= 1:
        prob += T_tail + pulp.lpSum(T[: L - 1]) >= c_all, "update_before_head_upload"

    # ------------------------------------------------------------------ [Constraint] memory
    # Memory rows in GiB: byte-sized coefficients (1e9-1e11) next to 0/1 variables hurt the solvers' tolerances.
    mem_exprs = [expr(mem[s], 1 / GIB, fixed + const_mem[s]) for s in range(S + 1)]
    model.extra["mem_exprs"] = mem_exprs
    if gpu_budget is not None:
        for s in range(S + 1):
            prob += mem_exprs[s] <= gpu_budget / GIB, f"gpu_memory_{s}"
    pinned_terms, nvme_terms = [], []
    for i in range(L):
        for o, v in opt[i].items():
            tier = OPTIONS[o][1]
            if tier == "cpu":
                pinned_terms.append((_offloaded_bytes(cm, i, o), v))
            elif tier == "nvme":
                nvme_terms.append((_offloaded_bytes(cm, i, o), v))
    if pinned_terms:
        prob += expr(pinned_terms, 1 / GIB) <= host_budget / GIB, "pinned_host_memory"
    if nvme_terms:
        prob += expr(nvme_terms, 1 / GIB) <= nvme_budget / GIB, "nvme_capacity"

    # ------------------------------------------------------------------ objective
    if objective == "time":
        # Objective: steady-state step time = sum of stage times + exposed tail (seconds).
        prob += pulp.lpSum(T) + T_tail, "step_time"
    else:
        # Objective: peak device bytes (used to find the smallest GPU budget that admits a plan).
        peak = _var(prob, "peak_gpu_gib", "Continuous")
        for s in range(S + 1):
            prob += peak >= mem_exprs[s], f"peak_{s}"
        prob += peak, "peak_gpu_gib"
        model.peak = peak
    return model


def _value(v: Any) -> float:
    if v is None:
        return 0.0
    x = v.varValue
    return 0.0 if x is None else float(x)


def _extract(model: _Model, cm: CostModel, source: str) -> Plan:
    L = cm.num_layers
    options, resident, ff, fb, rl = [], [], [], [], []
    for i in range(L):
        o = max(model.opt[i], key=lambda k: _value(model.opt[i][k]))
        options.append(o)
        resident.append(_value(model.res[i]) > 0.5)
        ff.append(max(model.yF[i], key=lambda a: _value(model.yF[i][a][0]) + _value(model.yF[i][a][1])))
        fb.append(max(model.yB[i], key=lambda a: _value(model.yB[i][a])) if not resident[-1] else 1)
        cand = {a: _value(v) for (oo, a), v in model.yR[i].items() if oo == o}
        rl.append(max(cand, key=cand.get) if cand else 1)
    return _make_plan(cm, options, resident, ff, fb, rl, source=source)


def _warm_start(model: _Model, plan: Plan, lookahead: int) -> bool:
    """Set initial values from ``plan`` when it is a point of this model; returns whether it was."""
    L = len(model.opt)
    values: list[tuple[Any, float]] = []
    for i in range(L):
        lp = plan.layers[i]
        o = _option_of(lp)
        if o not in model.opt[i]:
            return False
        for k, v in model.opt[i].items():
            values.append((v, 1.0 if k == o else 0.0))
        if model.res[i] is not None:
            values.append((model.res[i], 1.0 if lp.resident else 0.0))
        elif lp.resident:
            return False
        aF = lp.fetch_fwd_ahead if i > 0 else min(lp.fetch_fwd_ahead, 1)
        if aF not in model.yF[i]:
            return False
        for a, (ys, yr) in model.yF[i].items():
            values.append((ys, 1.0 if a == aF and not lp.resident else 0.0))
            if yr is not None:
                values.append((yr, 1.0 if a == aF and lp.resident else 0.0))
        if not lp.resident and lp.fetch_bwd_ahead not in model.yB[i]:
            return False
        for a, y in model.yB[i].items():
            values.append((y, 1.0 if (a == lp.fetch_bwd_ahead and not lp.resident) else 0.0))
        for (oo, a), y in model.yR[i].items():
            values.append((y, 1.0 if (oo == o and a == lp.reload_ahead) else 0.0))
        if _offloaded_bytes_needed(o) and (o, lp.reload_ahead) not in model.yR[i]:
            return False
    for v, x in values:
        v.setInitialValue(x)
    return True


# ------------------------------------------------------------------------------------------------ solving
def _resolve_solver(solver: str) -> str:
    if solver not in SOLVERS:
        raise ValueError(f"solver={solver!r} is not supported; use one of {SOLVERS}.")
    if solver == "cbc":
        return "cbc"
    try:
        import highspy  # noqa: F401

        return "highs"
    except ImportError as e:
        if solver == "highs":
            raise ImportError("solver='highs' needs HiGHS: pip install highspy (or use solver='cbc').") from e
        return "cbc"


@contextlib.contextmanager
def _quiet_stdout():
    """Silence file descriptor 1 (C libraries write there directly, past `sys.stdout`)."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


_CBC_RESULT = re.compile(r"^Result - (.+)$", re.M)
_CBC_OBJ = re.compile(r"^Objective value:\s+([-+0-9.eE]+)", re.M)
_CBC_BOUND = re.compile(r"^Lower bound:\s+([-+0-9.eE]+)", re.M)
_CBC_GAP = re.compile(r"^Gap:\s+([-+0-9.eE]+)", re.M)


def _solve(
    model: _Model, solver: str, time_limit: float, gap: float, warm: bool, threads: int | None = None
) -> dict[str, Any]:
    """Run the solver; return ``{"status", "has_solution", "gap", "objective", "bound", "seconds", "solver"}``
    read from the solver itself (CBC's log / HiGHS' info), not only from PuLP's summary."""
    import pulp

    t0 = time.perf_counter()
    report: dict[str, Any] = {"solver": solver}
    if solver == "cbc":
        fd, log = tempfile.mkstemp(prefix="lazytrain_cbc_", suffix=".log")
        os.close(fd)
        try:
            with warnings.catch_warnings():
                # PuLP 3.3 deprecates the bundled-CBC class in favour of a separately installed CBC; the bundled
                # binary is what works offline, so keep using it.
                warnings.simplefilter("ignore", DeprecationWarning)
                cmd = pulp.PULP_CBC_CMD(
                    msg=False, timeLimit=time_limit, gapRel=gap, warmStart=warm, logPath=log, threads=threads
                )
            model.prob.solve(cmd)
            with open(log) as f:
                text = f.read()
        finally:
            for p in (log,):
                if os.path.exists(p):
                    os.unlink(p)
        m = _CBC_RESULT.search(text)
        result = m.group(1).strip() if m else pulp.LpStatus[model.prob.status]
        report["solver_result"] = result
        obj = _CBC_OBJ.search(text)
        bound = _CBC_BOUND.search(text)
        g = _CBC_GAP.search(text)
        report["objective"] = float(obj.group(1)) if obj else None
        report["bound"] = float(bound.group(1)) if bound else report["objective"]
        if g:
            report["gap"] = float(g.group(1))
        elif report["objective"] is not None and report["bound"] is not None:
            report["gap"] = abs(report["objective"] - report["bound"]) / max(abs(report["objective"]), 1e-12)
        else:
            report["gap"] = None
        infeasible = "infeasible" in result.lower() or model.prob.status == pulp.LpStatusInfeasible
        has_solution = (not infeasible) and model.prob.sol_status in (
            pulp.LpSolutionOptimal,
            pulp.LpSolutionIntegerFeasible,
        )
        if infeasible:
            status = "infeasible"
        elif result.lower().startswith("optimal"):
            status = "optimal"
        elif has_solution:
            status = "time_limit" if "time" in result.lower() else "feasible"
        else:
            status = "no_solution"
    else:
        cmd = pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=gap, warmStart=warm, threads=threads)
        with _quiet_stdout():  # HiGHS prints its banner even with msg=False (it would corrupt `--json` output)
            model.prob.solve(cmd)
        h = model.prob.solverModel
        info = h.getInfo()
        ms = h.modelStatusToString(h.getModelStatus())
        report["solver_result"] = ms
        has_solution = int(getattr(info, "primal_solution_status", 0)) == 2
        report["objective"] = float(info.objective_function_value) if has_solution else None
        report["bound"] = float(info.mip_dual_bound)
        report["gap"] = float(info.mip_gap) if has_solution else None
        low = ms.lower()
        if "infeasible" in low:
            status, has_solution = "infeasible", False
        elif low == "optimal":
            status = "optimal"
        elif has_solution:
            status = "time_limit" if "time" in low else "feasible"
        else:
            status = "no_solution"
    report["status"] = status
    report["has_solution"] = has_solution
    report["seconds"] = time.perf_counter() - t0
    return report


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


def _min_memory_solution(cm, host_budget, nvme_budget, allowed_tiers, lookahead, solver, time_limit=30) -> Plan | None:
    model = _build(cm, None, host_budget, nvme_budget, allowed_tiers, lookahead, objective="memory")
    rep = _solve(model, _resolve_solver(solver), time_limit, 0.0, warm=False)
    if not rep["has_solution"]:
        return None
    plan = _extract(model, cm, "heuristic")
    return plan


def _infeasible(cm: CostModel, gpu_budget: int, host_budget: int, nvme_budget: int, allowed_tiers, lookahead, solver):
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
    if "nvme" in allowed_tiers and nvme_budget == 0:
        allowed_tiers = tuple(t for t in allowed_tiers if t != "nvme")  # no space: the tier cannot be used
    name = _resolve_solver(solver)
    heuristic = heuristic_plan(cm, gpu_budget, host_budget, nvme_budget, allowed_tiers)
    if heuristic is None:
        # The simple schedules do not fit; the least-memory plan of the MILP decides (and is the fallback).
        heuristic = _min_memory_solution(cm, host_budget, nvme_budget, allowed_tiers, lookahead, solver, time_limit)
        if heuristic is None or not _fits(evaluate_plan(heuristic, cm), gpu_budget, host_budget, nvme_budget):
            raise _infeasible(cm, gpu_budget, host_budget, nvme_budget, allowed_tiers, lookahead, solver)
    t_start = time.perf_counter()
    coarse = None
    if lookahead >= 2 and not fixed_slotting:
        # Solve with lookahead 1 first (a much smaller model): its plan is a point of this one and a strong warm start.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            coarse = solve(
                cm, gpu_budget, host_budget, nvme_budget, allowed_tiers, time_limit / 4, gap, solver,
                lookahead=1, allow_resident=allow_resident, warm_start=warm_start, threads=threads,
            )  # fmt: skip
        if coarse.source != "milp":
            coarse = None
    remaining = max(1.0, time_limit - (time.perf_counter() - t_start))
    model = _build(
        cm, gpu_budget, host_budget, nvme_budget, allowed_tiers, lookahead, "time", allow_resident, fixed_slotting
    )
    start = None
    candidates = [c for c in (warm_start, coarse, heuristic) if c is not None]
    if len(candidates) > 1:  # the best-evaluating candidate first
        candidates.sort(key=lambda c: evaluate_plan(c, cm).step_time_s if c.num_layers == cm.num_layers else math.inf)
    for cand in candidates:
        if cand is not None and cand.num_layers == cm.num_layers and cand.checkpoint_every == 1:
            if _fits(evaluate_plan(cand, cm), gpu_budget, host_budget, nvme_budget) and _warm_start(
                model, cand, lookahead
            ):
                start = cand
                break
    rep = _solve(model, name, remaining, gap, warm=start is not None, threads=threads)
    rep["seconds"] = time.perf_counter() - t_start
    if rep["status"] == "infeasible" and start is None:
        raise _infeasible(cm, gpu_budget, host_budget, nvme_budget, allowed_tiers, lookahead, solver)
    if rep["status"] == "infeasible":
        # A plan we hold fits by exact evaluation, so this is the solver's tolerance at a budget met with equality.
        rep["has_solution"] = False
    if rep["has_solution"]:
        plan = _extract(model, cm, "milp")
        if rep["status"] != "optimal":
            warnings.warn(
                f"MILP stopped before proving optimality ({rep['solver_result']}, gap={rep['gap']}); using its best "
                f"plan. Raise time_limit (now {time_limit} s) for a better one.",
                stacklevel=2,
            )
    else:
        warnings.warn(
            f"MILP solver returned no plan ({rep['solver_result']} after {rep['seconds']:.1f} s); using the heuristic "
            "plan (see `heuristic_plan`). Raise time_limit or install highspy.",
            stacklevel=2,
        )
        plan = start if start is not None else heuristic
        plan.source = "heuristic"
    ev = evaluate_plan(plan, cm)
    plan.predicted = ev.predictions()
    plan.solver = {
        "status": rep["status"] if plan.source == "milp" else f"heuristic ({rep['status']})",
        "seconds": rep["seconds"],
        "gap": rep["gap"],
        "name": name,
        "objective": rep["objective"],
    }
    return plan


def _check_budget(value: Any, option: str, minimum: int = 1) -> int:
    from ..units import parse_bytes

    if isinstance(value, int) and not isinstance(value, bool) and value == 0 and minimum == 0:
        return 0
    n = parse_bytes(value, option)
    if n is None or n < minimum:
        raise ValueError(f"{option}={value!r} must be a byte size >= {minimum} (e.g. '70GiB').")
    return n


# ------------------------------------------------------------------------------------------------ entry point
def _resolve_config(config: Any) -> tuple[Any, str]:
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


def max_feasible_batch(feasible: Any, max_batch_size: int, start: int = 1) -> int:
    """Largest ``b`` in ``[1, max_batch_size]`` with ``feasible(b)`` (monotone), or 0 when even 1 fails."""
    if not feasible(start):
        return 0
    lo, hi = start, start
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
) -> Plan:
    """Plan training of ``config`` on ``hardware`` (the entry point the trainer uses).

    Args:
        config: an HF config, a zoo name (``qwen2.5-7b``, ...) or a path to a ``config.json``.
        micro_batch_size: fixed batch (default 1); ignored with ``auto_batch_size``.
        auto_batch_size: search the micro-batch size with the highest predicted tokens/s; the largest feasible batch
            is recorded in ``plan.predicted["max_batch_size"]``.
        measured_times: ``(fwd_s, bwd_s)`` per layer measured at ``micro_batch_size`` (timed warm-up steps).
    """
    cfg, name = _resolve_config(config)
    hw = get_profile(hardware)
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size} must be >= 1.")
    gpu_b = hw.default_gpu_budget() if gpu_budget is None else _check_budget(gpu_budget, "gpu_budget")
    host_b = hw.default_host_budget() if host_budget is None else _check_budget(host_budget, "host_budget", 0)
    nvme_b = _check_budget(nvme_budget, "nvme_budget", 0)
    tiers = tuple(allowed_tiers)
    if "nvme" in tiers and nvme_b == 0:
        tiers = tuple(t for t in tiers if t != "nvme")
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
    if base.host_state_bytes > hw.host_memory_bytes:
        warnings.warn(
            f"{name}: the host model state ({base.host_state_bytes / 2**30:.0f} GiB: fp32 master, grads, 8-bit moments)"
            f" exceeds hardware {hw.name}'s host memory ({hw.host_memory_bytes / 2**30:.0f} GiB).",
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
        return plan

    cms: dict[int, CostModel] = {}

    def cm_at(b: int) -> CostModel:
        if b not in cms:
            cms[b] = base.with_batch(b) if b != b0 else base
        return cms[b]

    def feasible(b: int) -> bool:
        return milp_feasible(cm_at(b), gpu_b, host_b, nvme_b, tiers, lookahead, solver)

    b_max = max_feasible_batch(feasible, max_batch_size)
    if b_max == 0:
        raise _infeasible(cm_at(1), gpu_b, host_b, nvme_b, tiers, lookahead, solver)
    candidates = sorted(
        {b_max, max(1, (3 * b_max) // 4), max(1, b_max // 2)} | {2**k for k in range(8) if 2**k < b_max // 2}
    )
    best: Plan | None = None
    prev: Plan | None = None
    for b in reversed(candidates):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = solve(cm_at(b), **kw, warm_start=_rescale(prev, b))
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        prev = plan
        if best is None or plan.predicted["tokens_per_s"] > best.predicted["tokens_per_s"]:
            best = plan
    assert best is not None
    best.predicted["max_batch_size"] = b_max
    best.predicted["batch_sizes_tried"] = list(candidates)
    best.model = name
    return best


def _rescale(plan: Plan | None, b: int) -> Plan | None:
    if plan is None:
        return None
    out = Plan.from_dict(plan.to_dict())
    out.micro_batch_size = b
    return out


def milp_feasible(
    cm: CostModel,
    gpu_budget: int,
    host_budget: int,
    nvme_budget: int = 0,
    allowed_tiers: Sequence[str] = ("gpu", "cpu"),
    lookahead: int = DEFAULT_LOOKAHEAD,
    solver: str = "auto",
) -> bool:
    """Whether any plan of the MILP fits the budgets (fast path: the minimum-memory schedule fits)."""
    quick = evaluate_plan(min_memory_plan(cm, allowed_tiers), cm)
    if _fits(quick, gpu_budget, host_budget, nvme_budget):
        return True
    need = min_gpu_budget(cm, host_budget, nvme_budget, allowed_tiers, lookahead, solver)
    return need is not None and need <= gpu_budget
