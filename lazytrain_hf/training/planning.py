"""The plan a run trains with: hardware profile -> timed warm-up -> solve (or a baseline, or the default plan).

Owns `make_plan` (what `LazyTrainer.train()` runs when no plan is given), the timed warm-up (`measure_layer_times`,
`time_streamed_layers`: per-layer forward/backward seconds of pure compute, Note: [The warm-up measures two batch
sizes]), the bytes a plan moves per step (`predict_bytes`, `measure_offload_bytes`), plan files
(`load_plan_file`, `save_plan`: JSON and timeline picture in output_dir) and the checks made before anything is
attached or allocated (`check_plan_fits`, `check_host_memory`), and one plan for every data-parallel rank
(`plan_on_rank_zero`). Takes the model, the `LazyTrainingArguments` and a collated batch as plain values: it never
imports `transformers.Trainer` or the trainer floor, never changes the arguments (adopting the plan's batch size is
the trainer's) and leaves the model as it found it (parameters, gradients, hooks, train/eval mode, every RNG state).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
from transformers.utils import logging

from .. import models
from ..loading import weights_on_disk
from ..units import format_bytes
from .plan_files import write_plan

logger = logging.get_logger(__name__)

TIMELINE_FILE = "lazytrain_timeline.png"
# The measured profile of this machine (planner_hardware="auto"), cached in output_dir. The leading underscore keeps
# it out of `push_to_hub` (Trainer uploads output_dir with ignore_patterns=["_*", "checkpoint-*"]): the Hub gets the
# model, its card and the plan, not this machine's memory, disks and bandwidths.
PROFILE_FILE = "_lazytrain_hardware_profile.json"

# Attention implementations by what their backward saves: "eager" keeps the T x T probabilities, the fused kernels
# (sdpa, flash, flex) keep O(T) statistics like sdpa.
ATTENTION_COST_CLASS = {
    "eager": "eager",
    "sdpa": "sdpa",
    "flash_attention_2": "sdpa",
    "flash_attention_3": "sdpa",
    "flex_attention": "sdpa",
}


def unwrap_base(model: torch.nn.Module) -> torch.nn.Module:
    """The `*ForCausalLM` under PEFT / DDP wrappers."""
    inner = getattr(model, "module", model)
    if hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    return inner


def attention_cost_class(config: Any) -> str:
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in ATTENTION_COST_CLASS:
        raise ValueError(
            f"attn_implementation={impl!r} is not supported by the LazyTrain planner; use one of "
            f"{', '.join(ATTENTION_COST_CLASS)} (e.g. from_pretrained(..., attn_implementation='sdpa'))."
        )
    return ATTENTION_COST_CLASS[impl]


# ---------------------------------------------------------------------- planning
def make_plan(
    model: torch.nn.Module, args: Any, batch: dict[str, torch.Tensor], links: dict[str, float] | None = None
):
    """Profile -> warm-up timings -> plan, per ``args.planner_*``, for training ``model`` on micro-batches shaped
    like ``batch`` (one collated training micro-batch). In data parallel (rank 0) the MILP plans for the world
    (`world_of`): a rank's optimizer times and the world's reduces. ``links``: the data-parallel world's measured
    link bandwidths (`measure_world_links`), which replace the measured profile's (``planner_hardware="auto"``).

    Returns ``(plan, cost_model)``; ``cost_model`` is None for ``planner_policy="default"`` (no profile, warm-up or
    solve). With auto batch size the plan may choose another micro-batch size than ``batch``'s; the caller adopts it.
    """
    from ..planner import baselines, costmodel, hardware, memmodel, milp
    from ..planner.plan import Plan

    a = args
    base = unwrap_base(model)
    config = base.config
    kinds = models.layer_kinds(config)
    seq_len = int(batch["input_ids"].shape[1])
    mbs = int(batch["input_ids"].shape[0])

    if a.planner_policy == "default":
        plan = Plan.default(
            len(kinds),
            kinds,
            prefetch_depth=a.stream_prefetch_depth,
            micro_batch_size=mbs,
            seq_len=seq_len,
            loss_chunk_tokens=a.stream_loss_chunk_tokens,
            stream_embeddings=a.stream_embeddings,
            model=config.model_type,
        )
        return plan, None

    profile = (
        hardware.measure(
            cache_path=os.path.join(a.output_dir, PROFILE_FILE),
            device=str(a.device),
            nvme_dir=a.activation_nvme_dir,
        )
        if a.planner_hardware == "auto"
        else hardware.get_profile(a.planner_hardware)
    )
    if links and a.planner_hardware == "auto":
        profile = with_world_links(profile, links)
    # bf16=True computes an fp32 model with a bf16 copy (Note: [A bf16 compute copy of an fp32 model], hooks.py)
    dtype_bytes = 4 if next(base.parameters()).dtype == torch.float32 and not a.bf16 else 2
    attn = attention_cost_class(config)
    common = dict(loss_chunk_tokens=a.stream_loss_chunk_tokens, attn_implementation=attn)
    measured = None
    if a.planner_warmup_steps > 0 and weights_on_disk(model):
        logger.warning(
            "LazyTrain planner: the model's decoder layers are still on disk (lazytrain_hf.from_pretrained); the "
            "timed warm-up would read every layer into RAM before the host store is built, so layer times come "
            "from the hardware profile. Pass a profile measured on this machine (planner_hardware) for better ones."
        )
    elif a.planner_warmup_steps > 0:
        measured = measure_layer_times(model, batch, a.device, a.planner_warmup_steps)
    nvme_budget = 0
    if "nvme" in a.activation_tiers and a.activation_nvme_dir:
        nvme_budget = int(shutil.disk_usage(_existing_parent(a.activation_nvme_dir)).free * 0.9)

    # planner_host_budget bounds the whole host footprint: offloaded activations get what the state leaves of it
    # (check_host_memory then holds the plan to the whole budget)
    # the training state on NVMe (state_nvme_dir): where the default plan needs it, the MILP plans its I/O
    compute_dtype = torch.bfloat16 if a.bf16 else None
    p0 = Plan.default(len(kinds), kinds, stream_embeddings=a.stream_embeddings, model="")
    state_keys = place_state(p0, model, a, hybrid_8bit=a.optim_hybrid_8bit, compute_dtype=compute_dtype)
    pinned_budget = None
    if a.planner_host_budget is not None:
        state = host_footprint(p0, model, hybrid_8bit=a.optim_hybrid_8bit, compute_dtype=compute_dtype, args=a)
        pinned_budget = max(0, int(a.planner_host_budget) - (max(state.total, state.save_peak) - state.activations))
    if a.planner_policy == "milp":
        world = world_of(a)  # data parallel: a rank's optimizer times, the world's reduces (worldcost.for_world)
        plan = milp.plan_for_model(
            config,
            profile,
            seq_len=seq_len,
            micro_batch_size=mbs,
            auto_batch_size=a.planner_auto_batch_size,
            max_batch_size=a.planner_max_batch_size,
            gpu_budget=a.planner_gpu_budget,
            host_budget=pinned_budget,
            nvme_budget=nvme_budget,
            allowed_tiers=tuple(a.activation_tiers),
            time_limit=a.planner_time_limit,
            gap=a.planner_mip_gap,
            solver=a.planner_solver,
            dtype_bytes=dtype_bytes,
            measured_times=measured,
            state_nvme=[k for k in state_keys if 0 <= k < len(kinds)],
            gradient_accumulation_steps=int(a.gradient_accumulation_steps),
            stream_embeddings=bool(a.stream_embeddings),
            world=world if world.world_size > 1 else None,
            **common,
        )
    # the cost model of the batch the plan trains with (auto batch size may have changed it): the baselines and
    # the timeline are made from it; measured layer times apply to the measured batch only
    plan_mbs = plan.micro_batch_size if a.planner_policy == "milp" else mbs
    cm = costmodel.CostModel.from_config(
        config, profile, seq_len=seq_len, micro_batch_size=plan_mbs, dtype_bytes=dtype_bytes, **common
    )
    if measured is not None and plan_mbs == mbs:
        cm = cm.with_measured_times(*measured)
    cm = memmodel.with_accumulation(cm, a.gradient_accumulation_steps)
    cm = memmodel.with_streamed_embeddings(cm, bool(a.stream_embeddings))  # the plans stream them too
    if a.planner_policy != "milp":
        plan = baselines.make_baseline(a.planner_policy, cm)
    plan.loss_chunk_tokens = a.stream_loss_chunk_tokens
    plan.stream_embeddings = plan.stream_embeddings or a.stream_embeddings
    plan.model = plan.model or config.model_type
    set_dp_reduce(plan, a, cm)
    return plan, cm


def world_of(args: Any):
    """The data-parallel world this process runs in: ``args.world_size`` ranks, ``LOCAL_WORLD_SIZE`` per node."""
    from ..planner.world import World

    world_size = max(1, int(getattr(args, "world_size", 1) or 1))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) or world_size
    return World(world_size, max(1, world_size // local))


def measure_world_links(args: Any) -> dict[str, float] | None:
    """Note: [The world's links are measured] (training/world_links.py): on every rank of a data-parallel run
    whose plan is made from this machine's measured profile (``planner_hardware="auto"``, a policy other than
    ``"default"``), before rank 0 plans; None otherwise (one process, a bundled or given profile, no planning)."""
    import torch.distributed as dist

    world = world_of(args)
    if world.world_size <= 1 or args.planner_hardware != "auto" or args.planner_policy == "default":
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from .world_links import measure_links

    links = measure_links(world, args.device)
    logger.info("LazyTrain: the data-parallel world's links: " + ", ".join(f"{k} {v:.2f}" for k, v in links.items()))
    return links


def with_world_links(profile, links: dict[str, float]):
    """``profile`` with the link bandwidths ``links`` (`measure_world_links`), which its ``source`` names."""
    import dataclasses

    what = ", ".join(f"{k}={v:.3g}" for k, v in sorted(links.items()))
    source = f"{profile.source}; links measured by the data-parallel world: {what}".lstrip("; ")
    return dataclasses.replace(profile, **links, source=source)


def set_dp_reduce(plan, args: Any, cost_model=None) -> None:
    """``plan.dp_reduce`` and ``plan.dp_reduce_every`` for a data-parallel run: ``args.planner_dp_reduce`` /
    ``args.planner_dp_reduce_every`` where they name one (on every rank alike); for what is ``"auto"`` the planner's
    choice for this world and ``args.gradient_accumulation_steps`` (`dpreduce.decide`, the shortest simulated step
    among the eligible pairs, the step accumulators within ``planner_host_budget`` or the hardware's host memory)
    when ``cost_model`` is given (rank 0, after solving), else what the plan says (a plan file, a checkpoint's plan,
    the plan rank 0 broadcast; ``"host"`` / ``"micro_batch"`` for the default plan). One process: unchanged."""
    from ..planner import dpreduce

    world = world_of(args)
    if world.world_size <= 1:
        return
    mode = getattr(args, "planner_dp_reduce", "auto")
    every = getattr(args, "planner_dp_reduce_every", "auto")
    g = max(1, int(getattr(args, "gradient_accumulation_steps", 1) or 1))
    if cost_model is not None and "auto" in (mode, every):
        budget = getattr(args, "planner_host_budget", None)
        dpreduce.decide(plan, cost_model, world, g, budget, every=every, mode=mode)
        return
    if mode != "auto":
        plan.dp_reduce = mode
        if mode == "device" and every == "auto":
            plan.dp_reduce_every = "micro_batch"  # Note: [Gradients reduced once per step]: the host path only
    if every != "auto":
        plan.dp_reduce_every = every
        if every == "step" and mode == "auto":
            plan.dp_reduce = "host"


def predict_bytes(
    plan,
    model: torch.nn.Module,
    args: Any,
    compute_dtype: torch.dtype | None = None,
    batch: dict[str, torch.Tensor] | None = None,
) -> dict[str, int]:
    """Set ``plan.predicted["bytes_per_step"]``: bytes per lane of one optimizer step
    (``args.gradient_accumulation_steps`` micro-batches of ``plan.micro_batch_size`` x ``plan.seq_len`` tokens),
    exact for ``model`` (`lazytrain_hf.planner.schedule`); the executor's trace must show the same.

    Note: [Offloaded bytes are measured]
        What an ``offload_*`` layer moves is not what the cost model's saved-bytes formula counts: that formula is
        the device memory a kept layer holds (whole storages alive at the end of its forward), while the activation
        engine copies each saved tensor's dense region once (Note: [Offloaded storages are copied once]), including
        tensors a dropped graph branch frees later (the delta rule's final state). When the plan offloads a layer's
        saved tensors and ``batch`` is given, the bytes are therefore measured: one forward and backward of
        ``batch`` streamed with every layer on ``offload_cpu``, counted by the trace (`measure_offload_bytes`). A
        tensor freed before backward is offloaded but never reloaded, so the two directions differ.
    """
    from ..planner import schedule

    offload = None
    if batch is not None and any(lp.policy.startswith("offload") for lp in plan.layers) and not weights_on_disk(model):
        offload = measure_offload_bytes(model, batch, args.device, compute_dtype)
    sizes = schedule.sizes_from_model(
        model,
        plan,
        compute_dtype=compute_dtype,
        device=args.device,
        offload_bytes=offload,
        block_size=int(getattr(args, "optim_block_size", 256)),
        min_8bit_size=int(getattr(args, "optim_min_8bit_size", 4096)),
    )
    # the world this process runs in: the plan records it, and the bytes are this rank's (Note: [The training state
    # is partitioned by unit] in planner/world.py; the trace of each rank shows its own reduces and gathers), with the
    # gradients reduced where planner_dp_reduce says (Note: [Gradients reduced on the device skip the other ranks' D2H])
    world = world_of(args)
    plan.world_size, plan.nodes = world.world_size, world.nodes
    set_dp_reduce(plan, args)
    rank = int(getattr(args, "process_index", 0) or 0)
    out = schedule.bytes_per_step(plan, sizes, max(1, int(args.gradient_accumulation_steps)), plan.world, rank)
    from ..streaming.trace import LANES

    for lane in LANES:  # every lane the trace records; one process moves nothing on ``net`` (data parallel)
        out.setdefault(lane, 0)
    plan.predicted["bytes_per_step"] = out
    return out


def measure_offload_bytes(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device, compute_dtype=None
) -> list[tuple[int, int]]:
    """Per decoder layer, ``(bytes copied off the device, bytes reloaded)`` for ``batch`` when the layer's saved
    tensors are offloaded (Note: [Offloaded bytes are measured]): one forward and backward, gradients dropped,
    every RNG state and the train/eval mode restored, the model left as it was."""
    from ..planner.plan import LayerPlan, Plan
    from ..streaming import attach

    base = unwrap_base(model)
    kinds = models.layer_kinds(base.config)
    B, T = (int(x) for x in batch["input_ids"].shape[:2])
    plan = Plan(
        layers=[LayerPlan(index=i, kind=k, policy="offload_cpu") for i, k in enumerate(kinds)],
        micro_batch_size=B,
        seq_len=T,
        source="measure",
    )
    rng = _rng_state()
    was_training = model.training
    handle = attach(model, plan=plan, device=device, compute_dtype=compute_dtype)
    try:
        model.train()
        with torch.enable_grad():
            handle.causal_lm_loss(model, dict(batch)).backward()
        handle.synchronize()
        moved = {"offload": [0] * len(kinds), "reload": [0] * len(kinds)}
        for t in handle.trace.current["transfers"]:
            if t["what"] in moved:
                moved[t["what"]][t["layer"]] += t["bytes"]
        return list(zip(moved["offload"], moved["reload"]))
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
        model.train(was_training)
        _set_rng_state(rng)


def save_plan(plan, cost_model, output_dir: str) -> None:
    """Write the plan (JSON) and its simulated timeline (PNG, when matplotlib is installed) to ``output_dir``."""
    write_plan(plan, output_dir)
    logger.warning("LazyTrain plan:\n" + plan.table())
    try:
        from ..planner import simulate

        simulate.draw_timeline(simulate.simulate(plan, cost_model), os.path.join(output_dir, TIMELINE_FILE))
    except ImportError as e:  # matplotlib is optional (extra `plot`)
        logger.warning(f"timeline picture not drawn ({e}); pip install 'lazytrain-hf[plot]' to get it.")


def plan_on_rank_zero(make: Callable[[], Any], world_size: int) -> tuple[Any, bool]:
    """``make()`` on rank 0 only, its plan broadcast to every rank (Note: [One plan for every rank] in
    trainer.py): ``(plan, received)``, ``received`` True where the plan came from rank 0 (not made here). Without
    data parallel ``make()`` runs here. A planning error on rank 0 is raised on every rank."""
    import torch.distributed as dist

    if world_size <= 1 or not dist.is_available() or not dist.is_initialized():
        return make(), False
    from ..planner.plan import Plan

    box: list[Any] = [None]
    made = None
    if dist.get_rank() == 0:
        try:
            made = make()
            box = [("plan", made.to_json())]
        except Exception as e:
            box = [("error", f"{type(e).__name__}: {e}")]
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    kind, payload = box[0]
    if kind == "error":
        raise RuntimeError(f"planning failed on rank 0: {payload}")
    if dist.get_rank() == 0:
        return made, False
    return Plan.from_json(payload), True


def load_plan_file(path: str, output_dir: str | None = None):
    """The plan at ``path`` (`planner_plan`), to be executed as is (no profile, warm-up or solve); written to
    ``output_dir`` when given."""
    from ..planner.plan import Plan

    plan = Plan.from_json(path)
    if output_dir is not None:
        write_plan(plan, output_dir)
    return plan


# ---------------------------------------------------------------------- checks before anything is allocated
def check_plan_fits(
    plan, model: torch.nn.Module, args: Any, where: str | None = None, check_batch: bool = True
) -> None:
    """Refuse a plan made for another model or (``check_batch``) another micro-batch size than
    ``args.per_device_train_batch_size``, or one that needs a directory the arguments do not give."""
    base = unwrap_base(model)
    kinds = models.layer_kinds(base.config)
    src = f"the plan from {where}" if where else "the plan"
    fix = (
        "make a plan for this model and batch (`lazytrain plan --model <config.json> --batch-size N --save "
        "plan.json`) or drop planner_plan to plan at train() start"
    )
    if plan.num_layers != len(kinds):
        raise ValueError(
            f"{src}: field `layers` has {plan.num_layers} entries but the model has {len(kinds)} decoder layers; "
            f"{fix}."
        )
    for lp, kind in zip(plan.layers, kinds):
        if lp.kind != kind:
            raise ValueError(
                f"{src}: field `layers[{lp.index}].kind` is {lp.kind!r} but the model's layer {lp.index} is "
                f"{kind!r}; {fix}."
            )
    if check_batch and plan.micro_batch_size != args.per_device_train_batch_size:
        raise ValueError(
            f"{src}: field `micro_batch_size` is {plan.micro_batch_size} but per_device_train_batch_size is "
            f"{args.per_device_train_batch_size}; set per_device_train_batch_size={plan.micro_batch_size} "
            f"or {fix}."
        )
    nvme = [lp.index for lp in plan.layers if lp.tier == "nvme"]
    if nvme and not args.activation_nvme_dir:
        raise ValueError(
            f"{src}: layers {nvme} keep activations on the nvme tier but activation_nvme_dir is not set; pass "
            "activation_nvme_dir=/path/on/fast/disk or use a plan without the nvme tier."
        )
    if plan.state_nvme and not getattr(args, "state_nvme_dir", None):
        raise ValueError(
            f"{src}: field `state_nvme` keeps the training state of units {plan.state_nvme} on NVMe but "
            "state_nvme_dir is not set; pass state_nvme_dir=/path/on/fast/disk or use a plan with state_nvme=[]."
        )


# Host RAM left to the rest of the system when planner_host_budget is not set: 5% of the machine, at least 1 GiB.
HOST_RESERVE_FRACTION = 0.05
HOST_RESERVE_MIN_BYTES = 1 << 30


def default_host_budget() -> int | None:
    """Available host RAM (MemAvailable) minus the reserve (`HOST_RESERVE_FRACTION` of MemTotal, at least
    `HOST_RESERVE_MIN_BYTES`); None where /proc/meminfo is unreadable (not checked)."""
    available = _available_host_bytes()
    if available is None:
        return None
    return max(0, available - host_reserve_bytes())


def host_reserve_bytes() -> int:
    """The host RAM `default_host_budget` leaves to the system."""
    return max(HOST_RESERVE_MIN_BYTES, int(HOST_RESERVE_FRACTION * _meminfo().get("MemTotal", 0)))


def host_footprint(
    plan,
    model: torch.nn.Module,
    hybrid_8bit: bool = True,
    compute_dtype: torch.dtype | None = None,
    args: Any = None,
):
    """The `lazytrain_hf.planner.hostmem.HostFootprint` of training ``model`` with ``plan`` (None: the default plan
    of ``args``, as before the warm-up) and the `LazyTrainingArguments` ``args`` (device, gradient accumulation,
    8-bit block layout; None: a CUDA device, no accumulation, the optimizer's defaults). Reads shapes, dtypes and
    ``requires_grad`` only, so meta parameters (`lazytrain_hf.from_pretrained`) work."""
    from ..planner import hostmem
    from ..planner.plan import Plan

    base = unwrap_base(model)
    if plan is None:
        kinds = models.layer_kinds(base.config)
        plan = Plan.default(
            len(kinds), kinds, stream_embeddings=bool(getattr(args, "stream_embeddings", False)), model=""
        )
        if getattr(args, "state_nvme_dir", None):
            place_state(plan, model, args, hybrid_8bit=hybrid_8bit, compute_dtype=compute_dtype)
    kw: dict[str, Any] = {}
    if args is not None:
        kw = dict(
            device=str(args.device),
            gradient_accumulation_steps=int(args.gradient_accumulation_steps),
            block_size=int(getattr(args, "optim_block_size", hostmem.DEFAULT_BLOCK_SIZE)),
            min_8bit_size=int(getattr(args, "optim_min_8bit_size", hostmem.DEFAULT_MIN_8BIT_SIZE)),
        )
    return hostmem.run_footprint(model, plan, compute_dtype=compute_dtype, hybrid_8bit=hybrid_8bit, **kw)


def place_state(
    plan, model: torch.nn.Module, args: Any, hybrid_8bit: bool = True, compute_dtype: torch.dtype | None = None
) -> list[int]:
    """Set ``plan.state_nvme``: the streamed units whose training state lives in ``args.state_nvme_dir`` (none
    without it): with ``state_nvme_layers="auto"`` the fewest that bring the whole host footprint within
    ``planner_host_budget`` (else the available RAM minus the reserve), with ``"all"`` every one
    (`lazytrain_hf.planner.hostmem.place_state`). Returns the keys."""
    from ..planner import hostmem

    if not getattr(args, "state_nvme_dir", None):
        plan.state_nvme = []
        return []
    units = hostmem.units_of_model(model, plan)
    given = getattr(args, "planner_host_budget", None)
    budget = int(given) if given is not None else default_host_budget()

    def footprint(keys):
        plan.state_nvme = sorted(keys)
        return host_footprint(plan, model, hybrid_8bit=hybrid_8bit, compute_dtype=compute_dtype, args=args)

    keys = hostmem.place_state(plan, units, budget, footprint, everything=args.state_nvme_layers == "all")
    plan.state_nvme = keys
    return keys


def check_host_memory(
    plan,
    model: torch.nn.Module,
    hybrid_8bit: bool,
    compute_dtype: torch.dtype | None = None,
    args: Any = None,
    budget: int | None = None,
) -> None:
    """Refuse, before anything is allocated, a run whose whole host footprint (`host_footprint`: fp32 masters,
    compute copy, gradients, optimizer state, resident parameters' host bytes, pinned activation buffers, gradient
    staging, and the checkpoint-save transient) exceeds the host budget, with every term and what would fit.

    ``plan`` None checks the default plan (before the warm-up and the solve, which allocate the host store
    themselves); ``compute_dtype``: the compute copy's dtype when it is not the parameters' own (``bf16=True``).
    The budget: ``budget``, else ``args.planner_host_budget``, else `default_host_budget` (available RAM minus a
    reserve)."""
    fp = host_footprint(plan, model, hybrid_8bit=hybrid_8bit, compute_dtype=compute_dtype, args=args)
    given = budget if budget is not None else getattr(args, "planner_host_budget", None)
    limit = int(given) if given is not None else default_host_budget()
    need = max(fp.total, fp.save_peak)
    if limit is None or need <= limit:
        return
    source = (
        "planner_host_budget"
        if given is not None
        else f"the available host memory ({_available_host_bytes()} bytes) minus a reserve of "
        f"{format_bytes(host_reserve_bytes())}"
    )
    mbs = plan.micro_batch_size if plan is not None else None
    rest = need - fp.activations
    if fp.activations and rest <= limit:
        per_seq = fp.activations / max(1, mbs or 1)
        fits = int((limit - rest) // per_seq) if per_seq else 0
        hint = (
            f"per_device_train_batch_size <= {fits} fits" if fits >= 1 else "the pinned activations do not fit"
        ) + "; or allow the nvme tier (activation_tiers, activation_nvme_dir) so activations leave host memory"
    else:
        n_all = sum(p.numel() for p in model.parameters())
        nvme = (
            "even with every streamed layer's state in state_nvme_dir"
            if getattr(args, "state_nvme_dir", None)
            else "set state_nvme_dir=/path/on/nvme to keep the training state of streamed layers on NVMe"
        )
        hint = (
            f"even batch 1 does not fit: the model state alone needs {format_bytes(rest)} ({n_all} parameters; "
            f"{nvme}): train LoRA adapters (frozen weights need no master, gradients or optimizer state), stream "
            "the embeddings (stream_embeddings=True), or use a larger machine"
        )
    raise ValueError(
        f"host memory: this run needs {need} bytes ({format_bytes(need)}) at its peak ({fp.describe()}"
        f"{f', micro-batch {mbs}' if mbs else ''}) but {source} is {limit} bytes ({format_bytes(limit)}). {hint}; "
        "or set planner_host_budget to what this machine can give."
    )


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (Linux), else {}."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * 1024
    except OSError:
        return {}
    return out


def _available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None (not checked)."""
    return _meminfo().get("MemAvailable")


def _existing_parent(path: str) -> str:
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


# ---------------------------------------------------------------------- timed warm-up
def measure_layer_times(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device, steps: int
) -> tuple[list[float], list[float]]:
    """Per decoder layer, forward and backward seconds of pure compute at ``batch``'s micro-batch size, restoring
    every RNG state and the train/eval mode: warm-up never changes training.

    Note: [The warm-up measures two batch sizes]
        The timed passes hold every activation on the device, so they run at one and two sequences of ``batch``
        (rows sliced from it), never at the training batch: the warm-up fits wherever a plan can, and how time
        grows with the batch is measured, not assumed. Each layer's time at ``B`` sequences is the line through
        the two measurements, ``t(B) = t(1) + (t(2) - t(1)) (B - 1)`` (never below ``t(2)``): a fixed cost per
        call (kernel launches, the executor's hooks) plus a part that grows with the tokens. Times are the
        executor's compute spans (`StreamHandle.trace`: from the moment the layer's weights are bound to the end
        of its forward, from the start of its backward stage to its completion), so transfers and their waits are
        not counted as compute.
    """
    rng = _rng_state()
    was_training = model.training
    B = int(batch["input_ids"].shape[0])
    try:
        model.train()
        one = time_streamed_layers(model, _rows(batch, 1), device, max(1, steps))
        if B == 1:
            return one
        two = time_streamed_layers(model, _rows(batch, 2), device, max(1, steps))
        if B == 2:
            return two

        def at(t1: list[float], t2: list[float]) -> list[float]:
            return [max(b, a + (b - a) * (B - 1)) for a, b in zip(t1, t2)]

        return at(one[0], two[0]), at(one[1], two[1])
    finally:
        model.train(was_training)
        _set_rng_state(rng)


def _rows(batch: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    return {k: v[:n] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}


def time_streamed_layers(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device, passes: int
) -> tuple[list[float], list[float]]:
    """Median forward and backward seconds of pure compute per decoder layer over ``passes`` forward+backward passes
    of ``model`` streamed with every activation kept (the executor's compute spans, transfers excluded: Note: [The
    warm-up measures two batch sizes]), the first pass dropped (it pays one-off allocation costs). Parameters and
    gradients are left as they were. Used by the trainer's timed warm-up and by `benchmarks/gpu_check.py`."""
    from ..planner.plan import LayerPlan, Plan
    from ..streaming import attach

    kinds = models.layer_kinds(unwrap_base(model).config)
    B, T = (int(x) for x in batch["input_ids"].shape[:2])
    plan = Plan(
        layers=[LayerPlan(index=i, kind=k) for i, k in enumerate(kinds)],
        micro_batch_size=B,
        seq_len=T,
        source="warmup",
        optimizer_overlap=False,
    )
    n = len(kinds)
    handle = attach(model, plan=plan, device=device)
    try:
        handle.trace.keep_steps = passes + 1
        for _ in range(passes + (1 if passes > 1 else 0)):
            handle.causal_lm_loss(model, dict(batch)).backward()
            handle.zero_grad()
            handle.trace.end_step()
        first = 1 if passes > 1 else 0
        fwd: list[list[float]] = [[] for _ in range(n)]
        bwd: list[list[float]] = [[] for _ in range(n)]
        for k, s in enumerate(handle.trace.steps):
            if k < first:
                continue
            for kind, out in (("forward", fwd), ("backward", bwd)):
                for layer, secs in handle.trace.compute_seconds(kind, step=s["step"]).items():
                    if 0 <= layer < n:
                        out[layer].extend(secs)
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)

    def med(xs: list[float]) -> float:
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else 0.0

    return [med(x) for x in fwd], [med(x) for x in bwd]


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
