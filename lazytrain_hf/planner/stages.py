"""The stage model of one training step, and the exact evaluation of a plan under it.

Owns: the per-layer options (`OPTIONS`: activation policy x where its saved bytes live; `layer_options`: those a
layer can take), the legal transfer slots of each option, `evaluate_plan` (step time, memory at every stage and
predictions of a fixed plan), the budget test `fits_budgets`, and `plan_from_options` (options and slots -> `Plan`).
The MILP (`formulation.py`), the heuristics and the brute-force tests all read a plan through this model; the
simulator (`simulate.py`) is the independent referee and does not use it. Pure arithmetic on a `CostModel`: imports
neither torch nor pulp, knows no solver and not the runtime.

A step is the stages ``s = 0 .. 2L``: ``F_i = i``, ``H = L``, ``B_i = 2L - i``, then a tail ``tail`` between the
end of ``B_0`` and the start of the next step's ``F_0``. Within a stage the lanes overlap:

    T_s >= ondemand_h2d_s / BW_h2d + compute_s      (a transfer issued in the stage that needs it is waited for)
    T_s >= h2d_s / BW_h2d,   T_s >= d2h_s / BW_d2h,   T_s >= nvme_read_s / BW_nvme_r + nvme_write_s / BW_nvme_w

- ``compute``: ``f_i`` at ``F_i``, head fwd+bwd at ``H``, ``k_i`` (+ ``f_i`` when recomputed) at ``B_i``;
- ``h2d`` issued at ``s``: weight fetch of ``F_i`` at ``max(0, i - aF_i)`` (``F_0``'s is on demand, after the update
  of layer 0),
  of ``B_i`` at ``2L - i - aB_i``, activation reloads at ``2L - i - aR_i``, the lm_head upload at ``F_{L-1}``;
- ``d2h``: the offload of ``F_i``'s saved tensors at ``F_{i+1}``, the gradients of ``B_i`` at the next stage;
- NVMe: the write one stage after its D2H, the read one stage before its H2D reload.

Memory at every stage is the executor's memory model (`memmodel`): the slot pool of each layer kind for the whole
step (at least the weights the plan has in flight at once), resident weights, activations from their transfer's issue
stage (or their forward) to the end of their last use, each layer's working sets and gradients, the head stage and the
gradients of parameters that are not streamed, held until the optimizer step. The tail
holds the D2H of the last gradients, the CPU optimizer in layer order (``c_i`` = time from the end of ``B_0`` until
layer ``i`` is updated) and the embedding upload; with the optimizer overlapping the next forward, a fetch issued at
stage ``sigma`` must wait for its update: ``T_tail + sum_{j < sigma} T_j >= c_i``.

Minimising ``sum_s T_s + T_tail`` gives the steady-state step time (`evaluate_plan` computes the same number for a
fixed plan: every ``T_s`` at its lane bound, ``T_tail`` at the largest release it must cover).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .costmodel import CostModel
from .memmodel import (
    block_recompute_terms,
    carried_grad_bytes,
    copies_inline,
    end_of_backward_bytes,
    grads_leave_next_stage,
    held_grad_bytes,
    slot_pools,
    streamed_head_terms,
)
from .plan import INPUT_TIERS, LayerPlan, Plan, PlanError
from .schedule import bytes_per_step, sizes_from_cost_model

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


# ------------------------------------------------------------------------------------------------ helpers
def option_of(lp: LayerPlan) -> str:
    """The option (a key of `OPTIONS`) that layer plan ``lp`` takes."""
    if lp.policy == "recompute":
        return {"gpu": "rec_gpu", "cpu": "rec_cpu", "nvme": "rec_nvme"}[lp.input_tier]
    return lp.policy


def offloaded_bytes(cm: CostModel, i: int, option: str) -> int:
    """Bytes of layer i that leave the device after its forward and come back before its backward."""
    lc = cm.layers[i]
    if option in ("offload_cpu", "offload_nvme"):
        return lc.saved_bytes
    if option in ("rec_cpu", "rec_nvme"):
        return lc.input_bytes
    return 0


def has_offloaded_bytes(option: str) -> bool:
    """Whether ``option`` moves bytes off the device after forward (to cpu or nvme) and reloads them for backward."""
    return OPTIONS[option][1] != "gpu"


def reload_aheads(L: int, i: int, option: str, lookahead: int) -> list[int]:
    """Allowed ahead-values ``a`` of the reload for ``B_i``: after the offload (cpu: D2H at F_{i+1}; nvme: write at
    F_{i+2}, read one stage before the H2D)."""
    sB = 2 * L - i
    tier = OPTIONS[option][1]
    earliest = i + 2 if tier == "cpu" else i + 4
    return [a for a in range(lookahead + 1) if sB - a >= earliest]


def layer_options(L: int, i: int, allowed: Sequence[str]) -> list[str]:
    """The options of ``allowed`` layer i can take: those whose reload has a legal stage.

    Note: [Recompute on the device when no allowed tier can hold the input]
    Only the nvme tier can leave a layer without an option: a spill is written one stage after its D2H and read
    back one stage before its reload, so the last layer (only the head between ``F_{L-1}`` and ``B_{L-1}``) cannot
    use it. Recomputation is always allowed, so such a layer is recomputed from its input left on the device
    (``rec_gpu``): the D2H during the head and the reload at ``B_{L-1}`` would keep the same bytes allocated at
    every stage, at the cost of a write and a read. ``activation_tiers=["nvme"]`` therefore still plans.
    """
    legal = [o for o in allowed if not has_offloaded_bytes(o) or reload_aheads(L, i, o, 0)]
    return legal or ["rec_gpu"]


def fetch_fwd_aheads(i: int, lookahead: int) -> list[int]:
    """Allowed ahead-values ``a`` of the weight fetch for ``F_i``."""
    # Only inside the step: the executor issues a fetch reaching before stage 0 at stage 0 (`Plan.issue_schedule`),
    # so F_0's fetch is on demand, after the update of layer 0.
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
    bytes_per_step: dict[str, int] | None = None  # per lane, from the executor's schedule (schedule.py)
    slot_pools: dict[str, int] = field(default_factory=dict)  # per layer kind: bytes of its slot pool (memmodel)

    def predictions(self) -> dict[str, Any]:
        out = {
            "step_time_s": self.step_time_s,
            "tflops": self.tflops,
            "tokens_per_s": self.tokens_per_s,
            "peak_gpu_bytes": self.peak_gpu_bytes,
            "peak_host_bytes": self.peak_host_bytes,
            "pinned_host_bytes": self.pinned_host_bytes,
            "nvme_bytes": self.nvme_bytes,
        }
        if self.bytes_per_step is not None:
            out["bytes_per_step"] = dict(self.bytes_per_step)
        return out


def optimizer_finish_times(cm: CostModel) -> tuple[float, list[float], float]:
    """When the CPU optimizer finishes, measured from the end of backward: the embedding (after the last gradients
    came down), each layer in order, then the head. Shared by `evaluate_plan` and the MILP's tail constraints."""
    L = cm.num_layers
    t_d2h = ((cm.layers[0].grad_bytes if L else 0) + cm.embed_grad_bytes) / cm.d2h
    c_emb = t_d2h + cm.embed_optimizer_s
    c, acc = [], c_emb
    for i in range(L):
        acc += cm.optimizer_s_of(i)  # a layer whose state is on NVMe: its state I/O where that is longer
        c.append(acc)
    return c_emb, c, acc + cm.head_optimizer_s


def evaluate_plan(plan: Plan, cm: CostModel) -> Evaluation:
    """Step time, memory per stage and predictions of ``plan`` under the stage model (see module docstring)."""
    L = cm.num_layers
    plan.validate(L)
    if set(plan.state_nvme) & set(range(L)) != set(cm.state_nvme):
        cm = cm.with_state_nvme(plan.state_nvme)
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

    # streamed weights in flight per layer kind, from issue to use: the kind's slot pool holds at least these
    inflight: dict[str, list[int]] = {}

    def in_slots(i: int, lo: int, hi: int, nbytes: int) -> None:
        d = inflight.setdefault(cm.layers[i].kind, [0] * (S + 1))
        d[lo] += nbytes
        d[hi + 1] -= nbytes

    inline = copies_inline(cm)
    late_grads = grads_leave_next_stage(cm)
    K = plan.checkpoint_every
    release: list[tuple[int, float]] = []  # (issue stage, layer) of forward fetches that wait for the optimizer
    for lp in plan.layers:
        i = lp.index
        lc = cm.layers[i]
        sB = 2 * L - i
        option = option_of(lp)
        # ---- forward weights (a fetch reaching before stage 0 is issued at stage 0, as the executor does)
        sigma = max(0, i - lp.fetch_fwd_ahead)
        h2d[sigma] += lc.weight_bytes
        on_nvme = i in cm.state_nvme  # its fetches read the compute copy from NVMe first, its gradients go there
        if on_nvme and not lp.resident:
            nvr[sigma] += lc.weight_bytes
        if sigma == i:
            od[i] += lc.weight_bytes
        if not lp.resident:
            in_slots(i, sigma, i, lc.weight_bytes)
        release.append((sigma, i))
        comp[i] += lc.fwd_s
        # ---- backward weights
        if lp.resident:
            alive(0, S - 1, lc.weight_bytes)
            mem_tail += lc.weight_bytes
        else:
            sb = max(0, sB - lp.fetch_bwd_ahead)
            h2d[sb] += lc.weight_bytes
            if on_nvme:
                nvr[sb] += lc.weight_bytes
            if sb == sB:
                od[sB] += lc.weight_bytes
            # a layer kept bound from its forward to its backward holds its one slot throughout
            in_slots(i, i + 1 if plan.keeps_bound_after_forward(i) else sb, sB, lc.weight_bytes)
        comp[sB] += lc.bwd_s
        # ---- saved activations
        off = offloaded_bytes(cm, i, option)
        if K > 1:
            pass  # block checkpointing, handled below
        elif option == "keep":
            alive(i, sB, lc.saved_bytes)
        elif option == "rec_gpu":
            alive(i, sB, lc.input_bytes)
        else:
            if inline:  # the synchronous CPU engine copies each saved tensor out as it is saved (memmodel)
                alive(i, i, lc.input_bytes)
            else:
                alive(i, i + 1, lc.saved_bytes if option.startswith("offload") else lc.input_bytes)
            d2h[i + 1] += off
            tier = OPTIONS[option][1]
            ok = reload_aheads(L, i, option, 2 * L)
            if not ok:
                raise PlanError(f"layer {i}: {option} is impossible; its backward follows its forward too closely.")
            a = min(lp.reload_ahead, max(ok))  # clamp to the ordering: reload after offload
            sr = sB - a
            h2d[sr] += off
            if sr == sB:
                od[sB] += off
            # memory from the executor's issue (`Plan.issue_schedule`: from the stage after the forward), which a
            # plan's reload_ahead may put before the legal stage its copy waits for
            alive(sB - max(0, min(lp.reload_ahead, sB - i - 1)), sB, off)
            if tier == "cpu":
                pinned += off
            else:
                nvme += off
                nvw[i + 2] += off
                nvr[sr - 1] += off
        if K == 1 and option.startswith("rec"):
            comp[sB] += lc.fwd_s  # recomputation, and its activations live during B_i
            alive(sB, sB, lc.saved_bytes)
        # ---- working sets and gradients (memmodel): a forward that saves only its input holds ws_nosave; a
        # recomputed layer's backward first holds its saving forward's ws_fwd, then its gradients
        saves = option == "keep" or (option.startswith("offload") and not inline)
        alive(i, i, lc.ws_fwd_bytes if K == 1 and saves else lc.ws_nosave_bytes)
        recomputed = K > 1 or option.startswith("rec")
        alive(sB, sB, lc.ws_bwd_bytes + (max(0, lc.ws_fwd_bytes - lc.grad_bytes) if recomputed else 0))
        if i > 0 and late_grads:
            alive(sB, sB + 1, lc.grad_bytes)
            d2h[sB + 1] += lc.grad_bytes
        else:
            alive(sB, sB, lc.grad_bytes)
            if i > 0:
                d2h[sB + 1] += lc.grad_bytes
            elif late_grads:
                mem_tail += lc.grad_bytes
        if on_nvme and i > 0:
            nvw[sB + 1] += cm.state_io_bytes(i)[0]
    if K > 1:  # the block checkpoints and recomputation (memmodel); the recompute double buffer is the pool's
        terms = block_recompute_terms(cm, K, plan.layer_graphs)
        for lo, hi, nbytes in terms["alive"]:
            alive(lo, hi, nbytes)
        for s, secs in terms["comp"]:
            comp[s] += secs
        for s, nbytes in terms["h2d"]:
            h2d[s] += nbytes
        for s, nbytes in terms["od"]:
            od[s] += nbytes
    # ---- head stage
    comp[L] += cm.head_s
    head_held, embed_held = held_grad_bytes(cm)
    moments = []  # points inside a stage its total does not cover: (stage, bytes there beyond the fixed ones)
    if plan.stream_embeddings:  # memmodel.streamed_head_terms: transient slots, gradients leave as a layer's
        t = streamed_head_terms(cm)
        alive(L, L, t["head_slots"] + max(cm.head_ws_bytes, t["head_done"]))
        tied = not cm.head_params
        alive(L, 2 * L if tied else L + int(late_grads), t["head_grad"])
        resident = sum(lc.weight_bytes for lc, lp in zip(cm.layers, plan.layers) if lp.resident)
        moments.append((0, resident + t["embed_fwd"]))  # the lookup, before layer 0's forward
        # the embedding completes after B_0's layer did (its gradients in flight unless copied inline)
        moments.append((2 * L, resident + t["embed_done"] + (cm.layers[0].grad_bytes if late_grads else 0)))
        if late_grads:
            mem_tail += cm.embed_grad_bytes
        head_held = embed_held = 0
    else:
        alive(L, L, cm.head_ws_bytes)
        # gradients of the parameters that are not streamed stay on the device until the optimizer step (memmodel)
        alive(L, S - 1, head_held)  # the embedding's is made after B_0's layer is done: the tail holds it
        # under gradient accumulation both are held from the step's first micro-batch through the others
        carried_head, carried_embed = carried_grad_bytes(cm)
        alive(0, L, carried_head)  # and the head stage makes its gradient anew beside it (memmodel)
        alive(0, S - 1, carried_embed)
    d2h[L + 1] += cm.head_grad_bytes
    if cm.head_bytes and L >= 1:
        h2d[L - 1] += cm.head_bytes
    # the slot pool of each kind is allocated for the whole step: the executor's sizing, or the weights the plan has
    # in flight at once where that is more
    pools = slot_pools(plan, [lc.weight_bytes for lc in cm.layers], [lc.kind for lc in cm.layers])
    for kind, diff in inflight.items():
        run_k = most = 0
        for s in range(S):
            run_k += diff[s]
            most = max(most, run_k)
        pools[kind] = max(pools.get(kind, 0), most)
    pool = sum(pools.values())
    fixed = (0 if plan.stream_embeddings else cm.fixed_device_bytes) + pool  # resident embedding and head
    if getattr(cm, "serial_lanes", False):
        # Note: [Serial lanes on the CPU device] (hardware.py): copies run on the cores that compute
        stage_times = [comp[s] + h2d[s] / Bh + d2h[s] / Bd + nvr[s] / Bnr + nvw[s] / Bnw for s in range(S)]
    else:
        stage_times = [
            max(od[s] / Bh + comp[s], h2d[s] / Bh, d2h[s] / Bd, nvr[s] / Bnr + nvw[s] / Bnw) for s in range(S)
        ]
    # ---- tail: last gradients down, optimizer in layer order, embedding (+ pre-step fetches) up
    c_emb, c, c_all = optimizer_finish_times(cm)
    prefix = [0.0]
    for t in stage_times:
        prefix.append(prefix[-1] + t)
    if plan.optimizer_overlap and not getattr(cm, "serial_lanes", False):
        tail = c_emb + cm.embed_bytes / Bh
        for sigma, i in release:
            tail = max(tail, c[i] - prefix[sigma])
        if cm.head_bytes and L >= 1:
            tail = max(tail, c_all - prefix[L - 1])
    else:
        tail = c_all + cm.embed_bytes / Bh
    mem = []
    run = 0
    for s in range(S):
        run += mem_diff[s]
        mem.append(fixed + run)
    # the end of backward: every held gradient and the norm's fp32 copy of one or, under accumulation, the embedding's
    # new gradient (memmodel.end_of_backward_bytes)
    mem.append(
        fixed + mem_tail + head_held + embed_held + (0 if plan.stream_embeddings else end_of_backward_bytes(cm))
    )
    for s, nbytes in moments:
        mem[s] = max(mem[s], fixed + nbytes)
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
        bytes_per_step=bytes_per_step(plan, sizes_from_cost_model(cm, plan.stream_embeddings)),
        slot_pools=pools,
    )


# ------------------------------------------------------------------------------------------------ plans
def plan_from_options(
    cm: CostModel,
    options: Sequence[str],
    resident: Sequence[bool] | None = None,
    fetch_fwd: Sequence[int] | None = None,
    fetch_bwd: Sequence[int] | None = None,
    reload: Sequence[int] | None = None,
    **kwargs: Any,
) -> Plan:
    """The `Plan` with per-layer ``options`` and transfer slots (ahead-values; 1 where not given)."""
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
    kwargs.setdefault("stream_embeddings", bool(getattr(cm, "stream_embeddings", False)))
    return Plan(
        layers=layers,
        micro_batch_size=cm.micro_batch_size,
        seq_len=cm.seq_len,
        hardware=cm.hardware.name,
        model=cm.model_name,
        **kwargs,
    )


def options_for_tiers(allowed_tiers: Sequence[str]) -> list[str]:
    """The options whose saved bytes live on one of ``allowed_tiers``; a ValueError for an unknown or empty set."""
    bad = [t for t in allowed_tiers if t not in INPUT_TIERS]
    if bad:
        raise ValueError(
            f"allowed_tiers={tuple(allowed_tiers)!r}: unknown tier {bad[0]!r}; allowed are {INPUT_TIERS}."
        )
    if not allowed_tiers:
        raise ValueError("allowed_tiers is empty; pass at least one of ('gpu', 'cpu', 'nvme').")
    return [o for o, (_, tier) in OPTIONS.items() if tier in allowed_tiers]


def fits_budgets(ev: Evaluation, gpu_budget: int, host_budget: int, nvme_budget: int) -> bool:
    """Whether an evaluated plan fits the GPU, pinned host and NVMe budgets (bytes)."""
    return ev.peak_gpu_bytes <= gpu_budget and ev.pinned_host_bytes <= host_budget and ev.nvme_bytes <= nvme_budget
