"""The PuLP formulation of the LazyTrain MILP: variables, constraints and objective; warm start; plan extraction.

Owns: `build_milp` (one commented variable block, one `# [Constraint]` block per rule of the stage model in
`stages.py`, the objective: step time, or peak device memory when looking for the smallest GPU budget),
`set_warm_start` (a plan as the solver's initial point) and `extract_plan` (the solution as a `Plan`). The
per-stage loads are written as the same sums `stages.evaluate_plan` takes for a fixed plan, so the optimum's
objective is that plan's evaluated step time.

The plan space holds block checkpointing too (`Plan.checkpoint_every = K > 1`: the input of every K-th layer kept on
the device, each block recomputed from it at its top layer's backward stage), in both of the executor's modes
(`Plan.block_graphs`): ``"block"`` (the block recomputed once, with grad) and ``"layer"`` (MegaTrain's scheme: a
``no_grad`` pass keeping the block's hidden states, then one layer recomputed with grad per backward stage). One
binary ``blk[K, mode]`` per block size in `BLOCK_SIZES` and mode replaces every layer's per-layer option. So each
baseline's plan (`baselines.make_baseline`) is a point of the model (`set_warm_start` sets it, stage times included,
from `stages.evaluate_plan`). Does not run or choose a solver (`solver.py` does), imports pulp only inside its
functions and never torch, and does not know the runtime.

Note: [Block checkpointing as our executor runs it saves memory only when L / K > A / x]
In ``"block"`` mode the executor holds the saved tensors of all K layers of a block from its recomputation to their
backward. Against recomputing every layer from its own input it saves ``(L - L/K) x`` of inputs and adds
``(K - 1) A``; with ``A / x`` between 21 and 48 for the zoo models (`LayerCost.saved_bytes / input_bytes`) that is
a saving only at large L and small K. In ``"layer"`` mode a block holds K - 1 hidden states and one layer's graph
(``(K - 1) x + A`` beyond its checkpoint, `memmodel.block_recompute_terms`), always less than ``"block"`` at the
same K and than per-layer recomputation from the device (``L x + A``) once K < L, so it is the least-memory plan of
the device tier; it pays a third forward (and weight fetch) of each block layer below the top. Neither mode dominates
the other: ``"block"`` runs one forward less per layer and sits between per-layer recomputation and ``"layer"`` in
memory, so the MILP offers both and the budget decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .costmodel import CostModel
from .memmodel import (
    SLOT_ALIGN,
    block_recompute_terms,
    carried_grad_bytes,
    copies_inline,
    end_of_backward_bytes,
    grads_leave_next_stage,
    held_grad_bytes,
    pool_slots,
    streamed_head_terms,
)
from .plan import BLOCK_GRAPHS, Plan
from .stages import (
    OPTIONS,
    evaluate_plan,
    fetch_fwd_aheads,
    has_offloaded_bytes,
    layer_options,
    offloaded_bytes,
    optimizer_finish_times,
    option_of,
    options_for_tiers,
    plan_from_options,
    reload_aheads,
)

GIB = 2**30
# Block sizes K the MILP may choose for block checkpointing (MegaTrain's default checkpoint_interval is 4; a block
# larger than 8 holds more saved tensors at its recomputation than per-layer recomputation ever does).
BLOCK_SIZES: tuple[int, ...] = tuple(range(2, 9))


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
    blk: dict[tuple[int, str], Any]  # (K, Plan.block_graphs) -> binary (block checkpointing every K layers)
    pool: dict[str, Any]  # layer kind -> GiB of its slot pool (continuous)
    many: dict[str, Any]  # layer kind -> binary: at least two of its layers stream
    stream_embeddings: bool = False  # the model's embedding and head are streamed units (cm.stream_embeddings)


def _var(prob: Any, name: str, cat: str = "Binary") -> Any:
    """A variable attached to ``prob`` (PuLP >= 3.3 API, else the classic constructor); continuous ones are >= 0."""
    import pulp

    low = 0 if cat == "Continuous" else None
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound=low, cat=cat)
    return pulp.LpVariable(name, lowBound=low, cat=cat)


def block_sizes(num_layers: int, allowed_options: Sequence[str]) -> list[int]:
    """The block sizes of `BLOCK_SIZES` the MILP offers for ``num_layers`` layers (none without the device tier,
    where the block checkpoints live)."""
    if "rec_gpu" not in allowed_options:
        return []
    return [K for K in BLOCK_SIZES if K <= num_layers]


def build_milp(
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
    """The PuLP model of one step under ``cm``: minimise step time (``objective="time"``) within the budgets, or
    peak device memory (``"memory"``, ``gpu_budget=None``)."""
    import pulp

    L = cm.num_layers
    S = 2 * L + 1
    Bh, Bd, Bnr, Bnw = cm.h2d, cm.d2h, cm.nvme_r, cm.nvme_w
    allowed = options_for_tiers(allowed_tiers)
    prob = pulp.LpProblem("lazytrain_step_time" if objective == "time" else "lazytrain_min_memory", pulp.LpMinimize)

    # ------------------------------------------------------------------ decision variables
    opt: list[dict[str, Any]] = []  # opt[i][o] = 1: layer i uses option o (keep / offload_* / rec_<input tier>)
    res: list[Any] = []  # res[i] = 1: layer i's weights stay on the device all step (one upload per step)
    yF: list[dict[int, tuple[Any, Any]]] = []  # yF[i][a] = (streamed, resident): F_i's weights issued a stages ahead
    yB: list[dict[int, Any]] = []  # yB[i][a] = 1: B_i's weight fetch issued a stages before B_i
    yR: list[dict[tuple[str, int], Any]] = []  # yR[i][(o, a)] = 1: B_i's reload (option o) issued a stages ahead
    for i in range(L):
        # options whose backward follows too closely for their tier are left out (See Note: [Recompute on the
        # device when no allowed tier can hold the input])
        layer_opts = {o: _var(prob, f"opt_{i}_{o}") for o in layer_options(L, i, allowed)}
        opt.append(layer_opts)
        res.append(_var(prob, f"res_{i}") if allow_resident else None)
        yF.append(
            {
                a: (
                    _var(prob, f"yFs_{i}_{a}"),
                    _var(prob, f"yFr_{i}_{a}") if allow_resident else None,
                )
                for a in fetch_fwd_aheads(i, lookahead)
                if not fixed_slotting or a == min(i, 1)
            }
        )
        yB.append({a: _var(prob, f"yB_{i}_{a}") for a in range(lookahead + 1) if not fixed_slotting or a == 1})
        yR.append(
            {
                (o, a): _var(prob, f"yR_{i}_{o}_{a}")
                for o in layer_opts
                if has_offloaded_bytes(o)
                for a in reload_aheads(L, i, o, lookahead)
                if not fixed_slotting or a == min(1, max(reload_aheads(L, i, o, lookahead)))
            }
        )
    # blk[K, g] = 1: block checkpointing every K layers (Plan.checkpoint_every = K) recomputed as block_graphs = g,
    # in place of every opt[i][o]; only when the device tier is allowed (the block checkpoints live there)
    blk = {
        (K, g): _var(prob, f"blk_{K}" if g == "block" else f"blk_{g}_{K}")
        for K in block_sizes(L, allowed)
        for g in BLOCK_GRAPHS
    }
    T = [_var(prob, f"T_{s}", "Continuous") for s in range(S)]  # T[s]: duration of stage s (seconds)
    T_tail = _var(prob, "T_tail", "Continuous")  # end of B_0 -> start of the next F_0 (seconds)
    kinds = sorted({lc.kind for lc in cm.layers})
    # pool[k]: GiB of the slot pool of layer kind k, allocated the whole step (memmodel.slot_pools); many[k] = 1:
    # at least two layers of kind k stream (the pool then has at least two slots)
    pool = {k: _var(prob, f"pool_{n}", "Continuous") for n, k in enumerate(kinds)}
    many = {k: _var(prob, f"many_{n}") for n, k in enumerate(kinds)} if allow_resident else {}
    streamed = bool(getattr(cm, "stream_embeddings", False))
    model = _Model(prob, opt, res, yF, yB, yR, T, T_tail, blk, pool, many, streamed)
    blocked = pulp.lpSum(blk.values())  # 1: the plan is block checkpointed

    # ------------------------------------------------------------------ [Constraint] one choice per decision
    if blk:
        prob += blocked <= 1, "one_block_size"
    for i in range(L):
        # a layer takes one per-layer option, or none when the whole plan is block checkpointed
        prob += pulp.lpSum(opt[i].values()) + blocked == 1, f"one_option_{i}"
        if blk and allow_resident:
            # the block recomputation fetches every layer of the block (stage model, `evaluate_plan`)
            prob += res[i] + blocked <= 1, f"block_not_resident_{i}"
        prob += pulp.lpSum(v for pair in yF[i].values() for v in pair if v is not None) == 1, f"one_fwd_fetch_{i}"
        if allow_resident:
            prob += pulp.lpSum(r for _, r in yF[i].values()) == res[i], f"resident_upload_{i}"
            if i in cm.state_nvme:
                prob += res[i] == 0, f"state_on_nvme_not_resident_{i}"  # its state is not on the host
        prob += pulp.lpSum(yB[i].values()) == 1 - (res[i] if allow_resident else 0), f"bwd_fetch_unless_resident_{i}"
        for o in opt[i]:
            if has_offloaded_bytes(o):
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
    const_nvw = [0.0] * S
    inline = copies_inline(cm)
    late_grads = grads_leave_next_stage(cm)
    for i, lc in enumerate(cm.layers):
        sB = 2 * L - i
        w, A, x = lc.weight_bytes, lc.saved_bytes, lc.input_bytes
        const_comp[i] += lc.fwd_s
        const_comp[sB] += lc.bwd_s
        # state on NVMe (CostModel.with_state_nvme): every fetch first reads the compute copy from NVMe, the
        # gradients are written there after B_i (copies issued after a stage occupy the next)
        on_nvme = i in cm.state_nvme
        if on_nvme and i > 0:
            const_nvw[sB + 1] += cm.state_io_bytes(i)[0]
        # forward fetch: slot memory from issue to F_i when streamed; resident weights counted below
        for a, (ys, yr) in yF[i].items():
            sigma = i - a
            for y in (ys, yr):
                if y is not None:
                    h2d[sigma].append((w, y))
                    if on_nvme:
                        nvr[sigma].append((w, y))
                    if a == 0:
                        od[i].append((w, y))
        # resident weights: all stages and the tail
        if allow_resident:
            for s in range(S + 1):
                mem[s].append((w, res[i]))
        # backward fetch
        for a, y in yB[i].items():
            sb = sB - a
            h2d[sb].append((w, y))
            if on_nvme:
                nvr[sb].append((w, y))
            if a == 0:
                od[sB].append((w, y))
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
                if inline:  # the synchronous CPU engine copies each saved tensor out as it is saved (memmodel)
                    mem[i].append((x, v))
                else:
                    mem[i].append((off, v))
                    mem[i + 1].append((off, v))
                d2h[i + 1].append((off, v))
                if OPTIONS[o][1] == "nvme":
                    nvw[i + 2].append((off, v))
            if o.startswith("rec"):
                comp[sB].append((lc.fwd_s, v))  # recomputation
                mem[sB].append((A + max(0, lc.ws_fwd_bytes - lc.grad_bytes), v))  # recomputed activations in B_i
            # the forward's working set (memmodel): one that saves A, or one that keeps only its input
            saves = o == "keep" or (o.startswith("offload") and not inline)
            mem[i].append((lc.ws_fwd_bytes if saves else lc.ws_nosave_bytes, v))
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
        # working sets and gradients (memmodel); the gradients leave after B_i, one stage later on CUDA
        for z in blk.values():
            mem[i].append((lc.ws_nosave_bytes, z))
            mem[sB].append((max(0, lc.ws_fwd_bytes - lc.grad_bytes), z))
        const_mem[sB] += lc.ws_bwd_bytes + lc.grad_bytes
        if i > 0:
            const_d2h[sB + 1] += lc.grad_bytes
            if late_grads:
                const_mem[sB + 1] += lc.grad_bytes
        elif late_grads:
            const_mem[S] += lc.grad_bytes
    # block checkpointing (the terms `evaluate_plan` takes for checkpoint_every = K, memmodel.block_recompute_terms);
    # the recompute double buffer: the pool's extra slots ([Constraint] slot pools)
    for (K, g), z in blk.items():
        terms = block_recompute_terms(cm, K, g == "layer")
        for lo, hi, nbytes in terms["alive"]:
            for s in range(lo, hi + 1):
                mem[s].append((nbytes, z))
        for name, rows in (("comp", comp), ("h2d", h2d), ("od", od)):
            for s, v in terms[name]:
                rows[s].append((v, z))
    const_comp[L] += cm.head_s
    moments: list[tuple[int, int]] = []  # (stage, bytes beyond the resident weights and pools at a point inside it)
    if streamed:  # memmodel.streamed_head_terms (as `evaluate_plan`): transient slots, gradients leave as a layer's
        t = streamed_head_terms(cm)
        const_mem[L] += t["head_slots"] + max(cm.head_ws_bytes, t["head_done"])
        for s in range(L, (2 * L if not cm.head_params else L + int(late_grads)) + 1):  # tied: held to B_0's end
            const_mem[s] += t["head_grad"]
        if late_grads:
            const_mem[S] += cm.embed_grad_bytes
        moments.append((0, t["embed_fwd"]))  # the lookup, before layer 0's forward
        moments.append((2 * L, t["embed_done"] + (cm.layers[0].grad_bytes if late_grads else 0)))
    else:
        const_mem[L] += cm.head_ws_bytes
        # gradients of the parameters that are not streamed stay on the device until the optimizer step (memmodel)
        head_held, embed_held = held_grad_bytes(cm)
        for s in range(L, S):
            const_mem[s] += head_held
        const_mem[S] += head_held + embed_held + end_of_backward_bytes(cm)  # the norm's fp32 copy, or a new gradient
        carried_head, carried_embed = carried_grad_bytes(cm)  # under gradient accumulation: the earlier micro-batches'
        for s in range(S):
            const_mem[s] += carried_embed + (carried_head if s <= L else 0)  # memmodel.carried_grad_bytes
    const_d2h[L + 1] += cm.head_grad_bytes
    if cm.head_bytes and L >= 1:
        const_h2d[L - 1] += cm.head_bytes
    fixed = 0 if streamed else cm.fixed_device_bytes  # the resident embedding and head
    for k in kinds:  # the slot pools, every stage and the tail
        for s in range(S + 1):
            mem[s].append((GIB, pool[k]))

    def expr(terms: list[tuple[float, Any]], scale: float = 1.0, const: float = 0.0):
        # Note: a variable may appear in several terms (e.g. a recomputed layer's input and its recomputed
        # activations at B_i); LpAffineExpression keeps only the last coefficient of a repeated key, so sum first.
        coef: dict[Any, float] = {}
        for c, v in terms:
            if v is not None:
                coef[v] = coef.get(v, 0.0) + c * scale
        return pulp.LpAffineExpression(list(coef.items()), constant=const * scale)

    # ------------------------------------------------------------------ [Constraint] lanes overlap within a stage
    # Note: [Serial lanes on the CPU device] (hardware.py): copies run on the cores that compute, so a stage lasts
    # its compute plus every copy issued in it, and the optimizer overlaps nothing
    serial = bool(getattr(cm, "serial_lanes", False))
    for s in range(S):
        if serial:
            lanes_sum = (
                expr(comp[s], 1.0, const_comp[s])
                + expr(h2d[s], 1 / Bh, const_h2d[s])
                + expr(d2h[s], 1 / Bd, const_d2h[s])
                + expr(nvr[s], 1 / Bnr)
                + expr(nvw[s], 1 / Bnw, const_nvw[s])
            )
            prob += T[s] >= lanes_sum, f"serial_lanes_{s}"
            continue
        prob += T[s] >= expr(od[s], 1 / Bh) + expr(comp[s], 1.0, const_comp[s]), f"compute_after_ondemand_{s}"
        prob += T[s] >= expr(h2d[s], 1 / Bh, const_h2d[s]), f"h2d_lane_{s}"
        prob += T[s] >= expr(d2h[s], 1 / Bd, const_d2h[s]), f"d2h_lane_{s}"
        if nvr[s] or nvw[s] or const_nvw[s]:
            prob += T[s] >= expr(nvr[s], 1 / Bnr) + expr(nvw[s], 1 / Bnw, const_nvw[s]), f"nvme_lane_{s}"

    # ------------------------------------------------------------------ [Constraint] tail: optimizer and uploads
    c_emb, c, c_all = optimizer_finish_times(cm)
    emb_up = c_emb + cm.embed_bytes / Bh
    prob += T_tail >= emb_up, "tail_embedding_upload"
    if serial:
        prob += T_tail >= c_all + cm.embed_bytes / Bh, "serial_tail_whole_optimizer_step"
    # [Constraint] a fetch for the next forward waits for its layer's update (optimizer overlaps the next forward)
    for i in range(L):
        for a, (ys, yr) in yF[i].items():
            sigma = i - a
            prob += (
                T_tail + pulp.lpSum(T[:sigma]) >= expr([(1.0, ys), (1.0, yr)], c[i]),
                f"update_before_fetch_{i}_{a}",
            )
    if cm.head_bytes and L >= 1:
        prob += T_tail + pulp.lpSum(T[: L - 1]) >= c_all, "update_before_head_upload"

    # ------------------------------------------------------------------ [Constraint] slot pools
    # the executor sizes each kind's pool (memmodel.slot_pools) at min(n, max(1, depth) + 1 + extra) slots of its
    # largest layer. The weights in flight at a stage never exceed it (fetches issued at most depth stages ahead
    # target at most depth + 1 stages, one layer each), so they need no rows of their own.
    for n, k in enumerate(kinds):
        members = [i for i, lc in enumerate(cm.layers) if lc.kind == k]
        wk = -(-max(cm.layers[i].weight_bytes for i in members) // SLOT_ALIGN) * SLOT_ALIGN
        cap = len(members)
        streamed = [(1 - res[i]) if allow_resident else 1 for i in members]
        for i, st in zip(members, streamed):
            prob += pool[k] >= wk / GIB * st, f"pool_one_slot_{n}_{i}"
        if cap >= 2:
            if allow_resident:
                prob += pulp.lpSum(streamed) <= 1 + cap * many[k], f"pool_many_{n}"
                prob += pool[k] >= 2 * wk / GIB * many[k], f"pool_two_slots_{n}"
            else:
                prob += pool[k] >= 2 * wk / GIB, f"pool_two_slots_{n}"
        # a fetch issued a >= 2 stages ahead: a + 1 slots (and the block's extra ones, `pool_slots`)
        deep = [(a, y) for i in members for a, y in yB[i].items() if a >= 2]
        deep += [(a, ys) for i in members for a, (ys, _) in yF[i].items() if a >= 2]
        for m, (a, y) in enumerate(deep):
            prob += pool[k] >= min(cap, a + 1) * wk / GIB * y, f"pool_depth_{n}_{m}"
        # block checkpointing: extra slots, one more when no backward fetch of the kind is issued ahead
        ahead_b = pulp.lpSum(y for i in members for a, y in yB[i].items() if a >= 1)
        for (K, g), z in blk.items():
            tag = f"{K}" if g == "block" else f"{g}_{K}"
            prob += pool[k] >= min(cap, pool_slots(K, 1, 1)) * wk / GIB * z, f"pool_block_{n}_{tag}"
            prob += pool[k] >= min(cap, pool_slots(K, 1, 0)) * wk / GIB * (z - ahead_b), f"pool_block_b0_{n}_{tag}"
            for m, (a, y) in enumerate(deep):
                prob += (
                    pool[k] >= min(cap, pool_slots(K, a, 0)) * wk / GIB * (z + y - 1),
                    f"pool_block_depth_{n}_{tag}_{m}",
                )

    # ------------------------------------------------------------------ [Constraint] memory
    # Memory rows in GiB: byte-sized coefficients (1e9-1e11) next to 0/1 variables hurt the solvers' tolerances.
    mem_exprs = [expr(mem[s], 1 / GIB, fixed + const_mem[s]) for s in range(S + 1)]
    # points inside a stage its total does not cover (the streamed embedding's lookup and completion): the resident
    # weights and slot pools with the moment's own bytes
    always = [(lc.weight_bytes, res[i]) for i, lc in enumerate(cm.layers) if allow_resident]
    always += [(GIB, pool[k]) for k in kinds]
    mem_exprs += [expr(always, 1 / GIB, fixed + nbytes) for _, nbytes in moments]
    if gpu_budget is not None:
        for s, row in enumerate(mem_exprs):
            prob += row <= gpu_budget / GIB, f"gpu_memory_{s}"
    pinned_terms, nvme_terms = [], []
    for i in range(L):
        for o, v in opt[i].items():
            tier = OPTIONS[o][1]
            if tier == "cpu":
                pinned_terms.append((offloaded_bytes(cm, i, o), v))
            elif tier == "nvme":
                nvme_terms.append((offloaded_bytes(cm, i, o), v))
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
        for s, row in enumerate(mem_exprs):
            prob += peak >= row, f"peak_{s}"
        prob += peak, "peak_gpu_gib"
    return model


def _value(v: Any) -> float:
    if v is None:
        return 0.0
    x = v.varValue
    return 0.0 if x is None else float(x)


def extract_plan(model: _Model, cm: CostModel, source: str) -> Plan:
    """The solved model's decisions as a `Plan` (``source`` its `Plan.source`)."""
    L = cm.num_layers
    K, graphs = next((key for key, z in model.blk.items() if _value(z) > 0.5), (1, "block"))
    options, resident, ff, fb, rl = [], [], [], [], []
    for i in range(L):
        o = "rec_gpu" if K > 1 else max(model.opt[i], key=lambda k: _value(model.opt[i][k]))
        options.append(o)
        resident.append(_value(model.res[i]) > 0.5)
        ff.append(max(model.yF[i], key=lambda a: _value(model.yF[i][a][0]) + _value(model.yF[i][a][1])))
        fb.append(max(model.yB[i], key=lambda a: _value(model.yB[i][a])) if not resident[-1] else 1)
        cand = {a: _value(v) for (oo, a), v in model.yR[i].items() if oo == o}
        rl.append(max(cand, key=cand.get) if cand else 1)
    return plan_from_options(cm, options, resident, ff, fb, rl, source=source, checkpoint_every=K, block_graphs=graphs)


def set_warm_start(model: _Model, plan: Plan, lookahead: int, cm: CostModel | None = None) -> bool:
    """Set initial values from ``plan`` when it is a point of this model; returns whether it was.

    With ``cm`` the stage times and the tail are set too (from `evaluate_plan`), so the start is a complete solution:
    HiGHS takes a complete start as its incumbent at once, a partial one only after it solved the LP that completes
    it (which a time limit can cut short). ``plan.optimizer_overlap`` is not a decision: the model's plans overlap the
    optimizer with the next forward, which is never slower (`evaluate_plan`), so a plan without the overlap starts
    the model at that plan's decisions.
    """
    L = len(model.opt)
    K = plan.checkpoint_every
    if K > 1 and (K, plan.block_graphs) not in model.blk:
        return False
    if bool(plan.stream_embeddings) != model.stream_embeddings:
        return False
    values: list[tuple[Any, float]] = [(z, 1.0 if k == (K, plan.block_graphs) else 0.0) for k, z in model.blk.items()]
    for i in range(L):
        lp = plan.layers[i]
        o = option_of(lp)
        if K == 1 and o not in model.opt[i]:
            return False
        for k, v in model.opt[i].items():
            values.append((v, 1.0 if (k == o and K == 1) else 0.0))
        if model.res[i] is not None:
            values.append((model.res[i], 1.0 if lp.resident else 0.0))
        elif lp.resident:
            return False
        aF = min(lp.fetch_fwd_ahead, i)  # a fetch reaching before stage 0 is issued at stage 0 (issue_schedule)
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
        # a reload is issued no earlier than its offload allows (clamped as `evaluate_plan` and the executor do)
        legal = reload_aheads(L, i, o, 2 * L) if has_offloaded_bytes(o) else []
        aR = min(lp.reload_ahead, max(legal)) if legal else lp.reload_ahead
        for (oo, a), y in model.yR[i].items():
            values.append((y, 1.0 if (oo == o and a == aR and K == 1) else 0.0))
        if K == 1 and has_offloaded_bytes(o) and (o, aR) not in model.yR[i]:
            return False
    if cm is not None:
        overlapped = Plan.from_dict({**plan.to_dict(), "optimizer_overlap": True})
        ev = evaluate_plan(overlapped, cm)
        values += list(zip(model.T, ev.stage_times))
        values.append((model.T_tail, ev.tail_s))
        for k, v in model.pool.items():
            values.append((v, ev.slot_pools.get(k, 0) / GIB))
            if model.many:
                streamed = sum(1 for lp in plan.layers if cm.layers[lp.index].kind == k and not lp.resident)
                values.append((model.many[k], 1.0 if streamed >= 2 else 0.0))
    for v, x in values:
        v.setInitialValue(x)
    return True
