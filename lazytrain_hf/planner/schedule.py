"""The transfers of one training step under a plan, as the executor issues them: one schedule, three consumers.

`step_transfers` lists every copy the streaming executor makes in a step of ``plan`` (lane, what, layer, bytes, the
stage it is issued in), written from the executor's rules, which read the same `Plan` methods:

- weight fetches: ``plan.issue_schedule()`` (``fetch_fwd`` / ``fetch_bwd`` at ``max(0, need - ahead)``); a layer
  whose backward fetch would be issued at the stage right after its forward stays bound instead
  (`Plan.keeps_bound_after_forward`); resident layers are never fetched, their slot is uploaded once per optimizer
  step after their update;
- block checkpointing (``checkpoint_every = K > 1``): the block's top layer recomputes the block in its backward
  stage, fetching each layer that does not hold a slot; a layer whose backward fetch was issued by then stays bound
  for its backward, the others are fetched again (`Plan.block_fetches`; the same with ``block_graphs="layer"``,
  whose ``no_grad`` pass binds the block's layers below the top the same way);
- saved activations: ``offload_cpu`` / ``offload_nvme`` move what the layer saves (``saved``), a recomputed layer
  with its input on the cpu / nvme tier moves its input (``input``): D2H after the layer's forward (plus an NVMe
  write), H2D at the reload's issue stage (after an NVMe read);
- gradients: each streamed unit's gradients cross D2H in their own dtype once per micro-batch, when its backward is
  complete; gradients of parameters that are not streamed (embeddings, final norm and lm_head unless streamed,
  adapters) cross once per optimizer step, and the updated parameters go back up;
- streamed embeddings (``stream_embeddings``): the embedding unit is fetched for the forward (and again for the
  head when the lm_head is tied to it), the head unit (final norm + lm_head) once;
- training state on NVMe (``plan.state_nvme``, `lazytrain_hf.streaming.nvmestate`): every fetch of such a unit first
  reads its compute copy from NVMe (same stage); its gradients are written to its state file when its backward is
  complete (and, with gradient accumulation, read back before the next micro-batch adds into them); its optimizer
  step reads and writes its state once per step (``UnitBytes.state_read`` / ``state_write``);
- a data-parallel world (``plan.world_size`` ranks on ``plan.nodes`` nodes,
  Note: [The training state is partitioned by unit] in `lazytrain_hf.planner.world`): the transfers of one rank.
  On the ``net`` lane: ``reduce``, the rank's fp32 gradient of each streamed unit another rank owns
  (``4 * train_elems``), sent to the owner every micro-batch when the unit's backward is complete (the stage of its
  D2H gradient); ``gather``, the compute copy of each unit owned on another node that this rank receives for its
  node (`world.gather_receiver`), once per optimizer step after the owner's update. With ``plan.dp_reduce ==
  "device"`` a unit another rank owns is summed into the owner's device gradient instead (``reduce_device``, its
  gradient bytes in their dtype, the stage of its backward), and this rank copies nothing of it D2H; the owner's D2H
  stays. With ``plan.dp_reduce_every == "step"`` a ``reduce`` is sent once per optimizer step (``per_step``), after
  the last micro-batch (Note: [Gradients reduced once per step] in streaming/gradients.py). The state of a unit on
  NVMe is in its owner's files (Note: [The state on NVMe works partitioned] in
  streaming/nvmestate.py).
  With one rank there is no ``net`` traffic and `bytes_per_step` has no ``net`` key (the single-process trace and
  plan files are unchanged).

Consumers: the plan's ``predicted["bytes_per_step"]`` (`bytes_per_step`), which the executor's trace
(`lazytrain_hf.streaming.trace`) must equal exactly; the simulator (`simulate.py`), which replays these transfers
on lanes; and the tests, which compare the trace's issue stages with ``stage`` here. Pure arithmetic on byte counts
(`StepBytes`): `sizes_from_cost_model` gives them from the analytic cost model, `sizes_from_model` from a real
model's parameters and the host store's layout (exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .plan import Plan
from .world import World, gather_receiver, owners_by_key, unit_order

# ``net``: host to host between the ranks of a data-parallel world (gloo, shared memory); only with world_size > 1
LANES: tuple[str, ...] = ("h2d", "d2h", "nvme_read", "nvme_write", "net")


@dataclass(frozen=True)
class UnitBytes:
    """Byte counts of one streamed unit (a decoder layer, or the embedding / head unit).

    Attributes:
        weight: bytes one fetch moves (the unit's compute copy in the host store, alignment included); 0 when the
            unit is not streamed.
        grad: gradient bytes crossing D2H each micro-batch (trainable streamed parameters, in their dtype).
        saved: bytes the layer saves for backward when nothing is recomputed (what ``offload_*`` moves off the
            device).
        reloaded: what ``offload_*`` brings back (``saved`` less the tensors freed before backward); None: same.
        input: bytes of the layer's input hidden states (what a recomputed layer leaves on its input tier).
        train_elems: elements of the unit's fp32 gradient accumulator (`LayerLayout.train_elems`, alignment
            included): what a ``reduce`` moves (4 B each) in a data-parallel world.
        trainable: trainable elements of the unit's streamed parameters (their numels summed, no alignment): what
            its owner is dealt by (`lazytrain_hf.planner.world.unit_owners`).
    """

    weight: int = 0
    grad: int = 0
    saved: int = 0
    input: int = 0
    reloaded: int | None = None
    # the unit's training state is on NVMe (plan.state_nvme): its gradient accumulator's bytes in the state file
    # (written each micro-batch, read back before adding the next), and what its optimizer step reads and writes
    grad_file: int = 0
    state_read: int = 0
    state_write: int = 0
    train_elems: int = 0
    trainable: int = 0


@dataclass(frozen=True)
class StepBytes:
    """Byte counts of a model under a plan at the plan's micro-batch (see `UnitBytes`).

    Attributes:
        layers: one `UnitBytes` per decoder layer.
        embed, head: the streamed embedding and head units (zero when ``plan.stream_embeddings`` is off).
        tied: the lm_head weight is the embedding's (the head stage fetches the embedding unit again).
        resident_grad: gradient bytes of the trainable parameters that are not streamed, crossing once per step.
        resident_upload: bytes of those parameters uploaded after their update, once per step.
        upload: per decoder layer, bytes uploaded into a resident layer's slot after its update (0 when frozen).
    """

    layers: list[UnitBytes]
    embed: UnitBytes = field(default_factory=UnitBytes)
    head: UnitBytes = field(default_factory=UnitBytes)
    tied: bool = False
    resident_grad: int = 0
    resident_upload: int = 0
    upload: list[int] | None = None


@dataclass(frozen=True)
class Transfer:
    """One copy of a step.

    Attributes:
        lane: one of `LANES`.
        what: ``fetch_fwd``, ``fetch_bwd``, ``fetch_rec`` (block recomputation), ``offload``, ``reload``,
            ``spill`` (NVMe write), ``unspill`` (NVMe read), ``grad``, ``upload``, ``state`` (a unit's state on
            NVMe), ``node_copy`` (its owner's read of its updated compute copy, a data-parallel world), ``reduce``,
            ``reduce_device`` and ``gather`` (``net`` lane: a data-parallel world).
        layer: decoder layer index, ``-1`` for the embedding unit, ``L`` for the head unit, ``None`` for the
            parameters that are not streamed.
        stage: the stage the executor issues it in (``F_i = i``, ``H = L``, ``B_i = 2L - i``, ``2L + 1`` = after
            backward: the optimizer step).
        per_step: issued once per optimizer step (else once per micro-batch).
        peer: on the ``net`` lane, the other rank: the owner a ``reduce`` is sent to, the owner a ``gather`` comes
            from; None elsewhere.
    """

    lane: str
    what: str
    layer: int | None
    nbytes: int
    stage: int
    per_step: bool = False
    peer: int | None = None


def unit_owners_of(plan: Plan, sizes: StepBytes, world: World | None = None) -> dict[int, int]:
    """``{unit key: owner rank}`` of the streamed units of ``plan`` in ``world`` (default: the plan's), dealt by
    their ``trainable`` elements in `world.unit_order` (`world.owners_by_key`); ``-1``: nothing to train."""
    world = plan.world if world is None else world
    L = plan.num_layers
    elems = {i: u.trainable for i, u in enumerate(sizes.layers)}
    if plan.stream_embeddings:
        elems.update({-1: sizes.embed.trainable, L: sizes.head.trainable})
    return owners_by_key(elems, L, plan.stream_embeddings, world.world_size)


def step_transfers(
    plan: Plan,
    sizes: StepBytes,
    gradient_accumulation_steps: int = 1,
    world: World | None = None,
    rank: int = 0,
) -> list[Transfer]:
    """Every transfer of one micro-batch (and the per-step ones) of ``plan`` on rank ``rank`` of ``world`` (default:
    the plan's world, `Plan.world`), sorted by issue stage."""
    L = plan.num_layers
    if len(sizes.layers) != L:
        raise ValueError(f"sizes has {len(sizes.layers)} layers but the plan has {L}.")
    world = plan.world if world is None else world
    if not 0 <= rank < world.world_size:
        raise ValueError(f"rank={rank} is not a rank of a world of {world.world_size} (0..{world.world_size - 1}).")
    out: list[Transfer] = []
    tail = 2 * L + 1
    on_nvme = set(plan.state_nvme)
    multi = world.world_size > 1
    owner = unit_owners_of(plan, sizes, world) if multi else {}
    on_device = multi and plan.dp_reduce == "device"
    once = multi and plan.dp_reduce_every == "step"  # a reduce per optimizer step, not per micro-batch

    def unit_of(layer: int | None) -> UnitBytes | None:
        if layer is None:
            return None
        return sizes.embed if layer == -1 else sizes.head if layer == L else sizes.layers[layer]

    def owned(layer: int | None) -> bool:
        """This rank holds the unit's training state (every unit with one rank)."""
        return not multi or owner.get(layer, -1) == rank

    def add(lane: str, what: str, layer: int | None, n: int, stage: int, per_step: bool = False) -> None:
        if not n:
            return
        if layer in on_nvme and owned(layer) and lane == "h2d" and what.startswith("fetch"):
            # the compute copy from NVMe; another rank's unit's from RAM (Note: [The state on NVMe works partitioned])
            out.append(Transfer("nvme_read", what, layer, int(n), stage, per_step))
        remote = multi and lane == "d2h" and what == "grad" and layer is not None
        remote = remote and owner.get(layer, -1) not in (-1, rank)
        if remote and on_device:
            # Note: [Gradients reduced on the device skip the other ranks' D2H]: summed into the owner's device
            # gradient when the unit's backward is complete, in its own dtype; this rank copies nothing D2H
            out.append(Transfer("net", "reduce_device", layer, int(n), stage, peer=owner[layer]))
            return
        out.append(Transfer(lane, what, layer, int(n), stage, per_step))
        if remote:
            # the owner accumulates this rank's gradient: sent when the unit's backward is complete, every
            # micro-batch, or once per step from this rank's own accumulator (Note: [Gradients reduced once per step])
            n_red = 4 * unit_of(layer).train_elems
            out.append(Transfer("net", "reduce", layer, n_red, stage, per_step=once, peer=owner[layer]))
            return
        if layer in on_nvme and lane == "d2h" and what == "grad":
            u = unit_of(layer)
            out.append(Transfer("nvme_write", "grad", layer, u.grad_file, stage))
            if gradient_accumulation_steps > 1:
                n_acc = u.grad_file * (gradient_accumulation_steps - 1)
                out.append(Transfer("nvme_read", "grad", layer, n_acc, stage, per_step=True))

    fetch_stage = {}
    for s, items in plan.issue_schedule().items():
        for what, i in items:
            fetch_stage[(what, i)] = s
    for lp in plan.layers:
        i, u = lp.index, sizes.layers[lp.index]
        sB = 2 * L - i
        # ---- weights
        if lp.resident:
            up = sizes.upload[i] if sizes.upload is not None else (u.weight if u.grad else 0)
            add("h2d", "upload", i, up, tail, per_step=True)
        elif u.weight:
            # a backward fetch issued before the forward one (a deep backward prefetch of the last layers) is the
            # forward's too: the layer then stays bound to its backward
            add("h2d", "fetch_fwd", i, u.weight, min(fetch_stage[("fetch_fwd", i)], plan.bwd_issue_stage(i)))
            rec, bwd = plan.block_fetches(i)
            if rec:
                add("h2d", "fetch_rec", i, u.weight, 2 * L - plan.block_top(i))
            if bwd:
                add("h2d", "fetch_bwd", i, u.weight, min(fetch_stage[("fetch_bwd", i)], sB))
        # ---- saved activations
        if lp.policy.startswith("offload"):
            moved, back = u.saved, u.saved if u.reloaded is None else u.reloaded
        else:
            moved = back = u.input
        if plan.checkpoint_every == 1 and lp.tier != "gpu":
            add("d2h", "offload", i, moved, i)
            if lp.tier == "nvme":
                add("nvme_write", "spill", i, moved, i)
                add("nvme_read", "unspill", i, back, fetch_stage[("reload", i)])
            add("h2d", "reload", i, back, fetch_stage[("reload", i)])
        # ---- gradients
        add("d2h", "grad", i, u.grad, sB)
    if plan.stream_embeddings:
        add("h2d", "fetch_fwd", -1, sizes.embed.weight, 0)
        add("h2d", "fetch_fwd", L, sizes.head.weight, L)
        if sizes.tied:
            add("h2d", "fetch_fwd", -1, sizes.embed.weight, L)
        add("d2h", "grad", L, sizes.head.grad, L)
        add("d2h", "grad", -1, sizes.embed.grad, 2 * L)
    add("d2h", "grad", None, sizes.resident_grad, tail, per_step=True)
    add("h2d", "upload", None, sizes.resident_upload, tail, per_step=True)
    for k in sorted(on_nvme):
        u = unit_of(k)
        if owned(k):  # the unit's state file is its owner's
            add("nvme_read", "state", k, u.state_read, tail, per_step=True)
            add("nvme_write", "state", k, u.state_write, tail, per_step=True)
            if multi:  # its updated compute copy, read back from the file into the node copy
                add("nvme_read", "node_copy", k, u.weight, tail, per_step=True)
    if multi:
        node = world.node_of(rank)
        for k in unit_order(L, plan.stream_embeddings):
            o = owner.get(k, -1)
            if gather_receiver(world, o, node) == rank and unit_of(k).weight:
                out.append(Transfer("net", "gather", k, int(unit_of(k).weight), tail, per_step=True, peer=o))
    # Note: [Transfers of a stage in the executor's order]: within a stage the executor issues the embedding's
    # fetch first (its pre-forward hook), then the plan's issue schedule, ordered by the stage that needs each
    # transfer (`Plan.issue_schedule`), then what the stage's compute fetches itself (block recomputation, the head)
    rank = {id(t): _issue_rank(t, L, fetch_stage, plan) for t in out}
    out.sort(key=lambda t: (t.stage, rank[id(t)]))  # stable: an NVMe read stays before the copy it feeds
    return out


def _issue_rank(t: Transfer, L: int, fetch_stage: dict[tuple[str, int], int], plan: Plan) -> tuple:
    """Where ``t`` comes among the transfers issued in its stage (Note: [Transfers of a stage in the executor's
    order]): ``(0,)`` the embedding's fetch, ``(1, need, what, layer)`` an item of the plan's issue schedule (the
    tuple `Plan.issue_schedule` sorts by), ``(2,)`` the rest, in the order they were listed."""
    if t.what == "fetch_fwd" and t.layer == -1 and t.stage == 0:
        return (0,)
    i = t.layer
    if i is None or not 0 <= i < L or t.per_step:
        return (2,)
    if t.what in ("reload", "unspill"):
        return (1, 2 * L - i, "reload", i)
    if t.what == "fetch_bwd":
        return (1, 2 * L - i, "fetch_bwd", i)
    if t.what == "fetch_fwd":
        if t.stage < fetch_stage[("fetch_fwd", i)]:  # issued by the backward fetch (see above): its tuple
            return (1, 2 * L - i, "fetch_bwd", i)
        return (1, i, "fetch_fwd", i)
    return (2,)


def step_lanes(world: World) -> tuple[str, ...]:
    """The lanes a step's byte counts have in ``world``: `LANES`, without ``net`` for a single rank."""
    return LANES if world.world_size > 1 else tuple(lane for lane in LANES if lane != "net")


def bytes_per_step(
    plan: Plan,
    sizes: StepBytes,
    gradient_accumulation_steps: int = 1,
    world: World | None = None,
    rank: int = 0,
) -> dict[str, int]:
    """Bytes per lane of one optimizer step of ``gradient_accumulation_steps`` micro-batches on rank ``rank`` of
    ``world`` (default: the plan's world): `step_lanes` keys, so ``net`` only in a world of several ranks."""
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps} must be >= 1.")
    world = plan.world if world is None else world
    total = {lane: 0 for lane in step_lanes(world)}
    for t in step_transfers(plan, sizes, gradient_accumulation_steps, world, rank):
        total[t.lane] += t.nbytes * (1 if t.per_step else gradient_accumulation_steps)
    return total


# ---------------------------------------------------------------------------------------------- sizes
def sizes_from_cost_model(cm: Any, stream_embeddings: bool = False) -> StepBytes:
    """`StepBytes` from the analytic `CostModel` (weights without the store's alignment padding). With
    ``stream_embeddings`` the embedding and head are streamed units, else parameters that are not streamed."""
    layers = []
    for i, lc in enumerate(cm.layers):
        state = {}
        if i in getattr(cm, "state_nvme", ()):
            g, r, w = cm.state_io_bytes(i)
            state = {"grad_file": g, "state_read": r, "state_write": w}
        layers.append(
            UnitBytes(
                lc.weight_bytes,
                lc.grad_bytes,
                lc.saved_bytes,
                lc.input_bytes,
                train_elems=lc.params,
                trainable=lc.params,
                **state,
            )
        )
    embed = UnitBytes(cm.embed_bytes, cm.embed_grad_bytes, train_elems=cm.embed_params, trainable=cm.embed_params)
    head = UnitBytes(cm.head_bytes, cm.head_grad_bytes, train_elems=cm.head_params, trainable=cm.head_params)
    if stream_embeddings:
        return StepBytes(layers=layers, embed=embed, head=head, tied=not cm.head_bytes)
    return StepBytes(
        layers=layers,
        tied=not cm.head_bytes,
        resident_grad=cm.embed_grad_bytes + cm.head_grad_bytes,
        resident_upload=cm.embed_bytes + cm.head_bytes,
    )


def sizes_from_model(
    model: Any,
    plan: Plan,
    seq_len: int | None = None,
    compute_dtype: Any = None,
    attn_implementation: str | None = None,
    device: Any = "cpu",
    offload_bytes: list[int] | None = None,
    block_size: int = 256,
    min_8bit_size: int = 4096,
) -> StepBytes:
    """Exact `StepBytes` of ``model`` (a ``*ForCausalLM``, possibly under PEFT) under ``plan``: weights from the host
    store's layout of each layer's parameters (`lazytrain_hf.streaming.store.layer_layout`), gradients from the
    trainable parameters' dtypes, saved bytes from the cost model's formulas (exact for the supported layers, see
    ``tests/test_planner_costmodel.py``) at ``plan.micro_batch_size`` x ``seq_len`` (default ``plan.seq_len``).
    ``compute_dtype``: the compute copy's dtype when it differs from the parameters' (``bf16=True``). ``device``: the
    compute device; on the CPU an fp32 parameter that is not streamed is its own master, so its gradient and update
    move nothing. ``offload_bytes``: per layer, ``(bytes offloaded, bytes reloaded)`` when its saved tensors are
    offloaded, measured (`lazytrain_hf.training.planning.measure_offload_bytes`); else the saved-bytes formula."""
    import torch

    from .. import models
    from .costmodel import saved_activation_bytes
    from .layouts import hf_root, layer_layout, streamed_parameters, update_bytes

    on_nvme = set(plan.state_nvme)

    def state_terms(key: int, tensors: list, lay) -> dict[str, int]:
        if key not in on_nvme:
            return {}
        r, w = update_bytes(tensors, lay.compute_bytes, block_size, min_8bit_size)
        return {"grad_file": 4 * lay.train_elems, "state_read": r, "state_write": w}

    root = model
    inner = hf_root(model)  # the model the executor attaches to
    config = inner.config
    T = int(seq_len or plan.seq_len)
    B = int(plan.micro_batch_size)
    attn = attn_implementation or getattr(config, "_attn_implementation", None) or "sdpa"
    attn = "eager" if attn == "eager" else "sdpa"

    def cdt(p: torch.Tensor) -> torch.dtype:
        return compute_dtype if compute_dtype is not None and p.dtype == torch.float32 else p.dtype

    layers_mod = models.decoder_layers(inner)
    streamed: set[int] = set()
    units, uploads = [], []
    act_dtype = None
    for i, layer in enumerate(layers_mod):
        params = list(layer.parameters())
        s_params = streamed_parameters(params)
        streamed.update(id(p) for p in s_params)
        tensors = [(p.numel(), p.dtype, p.requires_grad) for p in s_params]
        lay = layer_layout(tensors, compute_dtype)
        grad = sum(p.numel() * cdt(p).itemsize for p in s_params if p.requires_grad)
        act_dtype = act_dtype or (cdt(params[0]) if params else torch.float32)
        db = act_dtype.itemsize
        reloaded = None
        if offload_bytes is not None:
            saved, reloaded = (int(x) for x in offload_bytes[i])
        else:
            saved = saved_activation_bytes(config, i, "keep", B, T, db, attn_implementation=attn)
        inp = B * T * int(config.hidden_size) * db
        units.append(
            UnitBytes(
                lay.compute_bytes if s_params else 0,
                grad,
                saved,
                inp,
                reloaded,
                train_elems=lay.train_elems if s_params else 0,
                trainable=sum(n for n, _, t in tensors if t),
                **state_terms(i, tensors, lay),
            )
        )
        uploads.append(lay.compute_bytes if s_params and grad else 0)
    embed_mod, norm_mod, head_mod = models.embed_tokens(inner), models.final_norm(inner), models.lm_head(inner)
    embed_params = list(embed_mod.parameters())
    embed_ids = {id(p) for p in embed_params}
    tied = any(id(p) in embed_ids for p in head_mod.parameters())
    head_params = list(norm_mod.parameters()) + [p for p in head_mod.parameters() if id(p) not in embed_ids]
    embed = head = UnitBytes()
    if plan.stream_embeddings:

        def unit(ps: list[torch.Tensor], key: int) -> UnitBytes:
            if not ps:
                return UnitBytes()
            tensors = [(p.numel(), p.dtype, p.requires_grad) for p in ps]
            lay = layer_layout(tensors, compute_dtype)
            g = sum(p.numel() * cdt(p).itemsize for p in ps if p.requires_grad)
            return UnitBytes(
                lay.compute_bytes,
                g,
                train_elems=lay.train_elems,
                trainable=sum(n for n, _, t in tensors if t),
                **state_terms(key, tensors, lay),
            )

        embed, head = unit(embed_params, -1), unit(head_params, len(layers_mod))
        streamed.update(id(p) for p in embed_params + head_params)
    on_cpu = torch.device(device).type == "cpu"
    res = [p for p in root.parameters() if id(p) not in streamed and p.requires_grad]
    # Note: the updater aliases an fp32 parameter on the CPU device as its own master (training/updater.py)
    res_bytes = sum(p.numel() * cdt(p).itemsize for p in res if not (on_cpu and cdt(p) == torch.float32))
    return StepBytes(
        layers=units,
        embed=embed,
        head=head,
        tied=tied,
        resident_grad=res_bytes,
        resident_upload=res_bytes,
        upload=uploads,
    )
