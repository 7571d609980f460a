"""Host memory of a LazyTrain run, term by term, from the model's parameters (or their counts) and the plan.

One function, `host_footprint`, gives every term of what a run holds in host RAM; `HostFootprint.total` is the peak
over a training step and `HostFootprint.save_peak` the peak over a checkpoint save. The terms (``n`` elements of a
tensor, ``db`` bytes of the compute dtype, ``bs`` the optimizer's 8-bit block size):

- ``masters``: fp32 masters that are not the compute copy, pageable: streamed layers whose compute copy is not
  fp32 (4 B per trainable element, `layer_layout`), and the fp32 host masters of resident trainable parameters
  that are not themselves fp32 CPU tensors (`LayerwiseUpdater`);
- ``compute``: the streamed layers' compute copies, alignment padding included (`layer_layout`): the pinned fetch
  source on CUDA. For an fp32 model it *is* the master (Note: [Compute copy aliases the fp32 master]);
- ``grads``: fp32 gradient accumulators of the streamed trainable parameters (4 B per element, padding included);
- ``optimizer``: `HybridAdamW8bit` state per optimizer tensor (one per trainable parameter): ``2 * (n + 4 *
  ceil(n / bs))`` for tensors of at least ``min_8bit_size`` elements (uint8 codes + fp32 absmax of m and v,
  `Quantized8bit`), ``8 * n`` below (fp32 m and v), as `HybridAdamW8bit.state_bytes` counts it; ``8 * n`` for
  every tensor with torch AdamW (``hybrid_8bit=False``);
- ``activations``: the plan's pinned activation buffers (``plan.predicted["pinned_host_bytes"]``);
- ``staging``: pinned gradient staging (exact-size registered buffers), with gradient accumulation (micro-batches
  after the first copy a layer's device gradient into host staging before adding it to the accumulator: Note: [Host
  accumulators are read only after their copy landed], streaming/engine.py) and whenever gradients are not fp32
  (they cross in their own dtype and are upcast on the host: Note: [Gradients cross in their own dtype]); bounded by
  `GRAD_STAGING_LAYERS` layers of gradients in the compute dtype;
- ``resident``: host bytes of the parameters that are not streamed: their fp32 gradient copies the optimizer takes
  at each step on CUDA (``4 * n``);
- ``device_on_host``: on a CPU device, device memory is host memory: the resident parameters and their gradients,
  the slot pools and dedicated slots, one streamed embedding / head transient slot, one layer's device gradients
  on their way to the accumulators, and for a tied trainable embedding the two gradients autograd sums (the lm_head's
  and the lookup's; the sum is the gradient counted before);
- ``checkpoint``: the transient of a save, written layer by layer from the host store (Note: [Checkpoints are
  streamed from the host store], training/checkpoints.py): at most one unit's tensors materialised at once;
- ``state_windows``: for units whose state is on NVMe (``state_nvme``, `lazytrain_hf.streaming.nvmestate`), which
  hold none of the terms above but the fp32 moments of their tensors under ``min_8bit_size``: the host windows
  their I/O goes through: `STATE_FETCH_WINDOWS` compute-copy windows of weight fetches and `STATE_GRAD_WINDOWS`
  gradient windows (each of a different unit: the largest ones) or, in the optimizer step, which never overlaps a
  backward, its compute window (the largest unit) and its `STATE_CHUNK_WINDOWS` chunk windows (Note: [The out-of-core
  optimizer step is chunked]).

In a data-parallel world (`lazytrain_hf.planner.world`, Note: [The training state is partitioned by unit]) the terms
are a rank's (`host_footprint` with ``world`` and ``rank``) plus what a node holds once (`WorldFootprint`):

- ``shared``: the streamed units' compute copies (and the originals of their rounded frozen parameters), ONE copy
  per node in shared memory that every rank of the node fetches from; not in a rank's `HostFootprint.total`;
- ``masters``, ``grads``, ``optimizer`` of a streamed unit, its state file and its gradient / optimizer windows on
  NVMe: only on the unit's owner (summed over the ranks: one copy of each);
- ``reduce_staging``: pinned fp32 staging of the gradients the rank sends to other owners (the ``reduce`` of
  `lazytrain_hf.planner.schedule`), at most `REDUCE_STAGING_UNITS` units at once, the largest it does not own;
- ``step_grads``: with ``dp_reduce_every == "step"`` (Note: [Gradients reduced once per step] in
  streaming/gradients.py) instead of ``reduce_staging``: a pinned fp32 accumulator of every trainable streamed unit
  the rank does not own, where its gradient is summed over the micro-batches of a step before the one reduce;
- everything else as with one rank, on every rank: the resident parameters (every rank updates them), pinned
  activations, gradient staging, the CPU device's memory, the checkpoint transient, the fetch windows of units on
  NVMe. A node holds ``shared`` once plus the terms of each of its ranks (`WorldFootprint.node_total`).

Not counted: the model's own tensors before the store replaces them (each streamed parameter's storage is released
as its layer is stored), Python and library overhead, the activations of one layer's forward on a CPU device, and the
model given back at the end of `train()`: with one rank a copy of the streamed parameters made while the store still
exists; in a data-parallel world nothing more, its parameters are views of the node's shared copy (Note: [Parameters
given back share the node copy]).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .layouts import ALIGN_BYTES, align_up, layer_layout
from .world import World, unit_owners

# Gradient staging in flight at once with gradient accumulation (the bound the engine's staging keeps): two layers
# of device gradients in the compute dtype, one being copied while the previous one is added on the host.
GRAD_STAGING_LAYERS = 2
# Host windows of units whose state is on NVMe (lazytrain_hf.streaming.nvmestate): fetch windows in flight (one per
# fetch whose copy has not landed: the prefetch and the layer computing), gradient windows (two layers' gradients in
# flight, Note: [Two stages of copies in flight] in streaming/engine.py), optimizer chunk windows
STATE_FETCH_WINDOWS = 2
STATE_GRAD_WINDOWS = 2
STATE_CHUNK_WINDOWS = 5
# Pinned fp32 staging of gradients sent to their owners in a data-parallel world: one unit being sent while the next
# one's gradient lands (Note: [Two stages of copies in flight] in streaming/engine.py)
REDUCE_STAGING_UNITS = 2
# The 8-bit state layout of HybridAdamW8bit's defaults (block 256, fp32 moments below 4096 elements, as bitsandbytes)
DEFAULT_BLOCK_SIZE = 256
DEFAULT_MIN_8BIT_SIZE = 4096


TERM_NAMES = {
    "masters": "fp32 masters",
    "compute": "compute copy",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "activations": "pinned activations",
    "staging": "gradient staging",
    "resident": "resident parameters' gradient copies",
    "device_on_host": "device memory in host RAM (CPU device)",
    "checkpoint": "checkpoint-save transient",
    "state_windows": "windows of the state on NVMe",
    "reduce_staging": "reduce staging",
    "step_grads": "accumulators of units owned elsewhere",
    "shared": "node-shared compute copy (once per node)",
}


@dataclass
class HostFootprint:
    """Host bytes of a run, per term (see the module docstring); `total` is the training-step peak."""

    masters: int = 0
    compute: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    staging: int = 0
    resident: int = 0
    device_on_host: int = 0
    checkpoint: int = 0
    state_windows: int = 0
    # bytes of the state files of the units on NVMe (not host memory; what state_nvme_dir must hold)
    nvme_state: int = 0
    # a data-parallel world: fp32 staging of the gradients sent to other owners (in `total`), and the node's one
    # shared compute copy (NOT in this rank's `total`: `WorldFootprint` counts it once per node)
    reduce_staging: int = 0
    shared: int = 0
    # dp_reduce_every == "step": fp32 accumulators of the units other ranks own (in `total`)
    step_grads: int = 0

    @property
    def state(self) -> int:
        """The model state in host RAM: masters, compute copy, gradients, optimizer state, resident parameters' host
        bytes, and the windows of the state on NVMe."""
        return self.masters + self.compute + self.grads + self.optimizer + self.resident + self.state_windows

    @property
    def total(self) -> int:
        """Peak host bytes over a training step: the state, pinned activations, staging and (CPU) device memory."""
        return (
            self.state + self.activations + self.staging + self.device_on_host + self.reduce_staging + self.step_grads
        )

    @property
    def save_peak(self) -> int:
        """Peak host bytes over a checkpoint save (after a step): `total` without staging, plus the save transient."""
        return self.total - self.staging + self.checkpoint

    # the pinned part, set by `host_footprint`: compute copies + gradient accumulators (their layout sizes, each
    # rounded to ALIGN_BYTES as `PinnedArena.carve` places them) + pinned activation buffers
    pinned_store: int = 0

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the one pinned arena of a CUDA run (`HostStore.reserve`): the store's pinned buffers and the
        pinned activation buffers."""
        return self.pinned_store + self.activations

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "state": self.state, "total": self.total, "save_peak": self.save_peak}

    def describe(self) -> str:
        from ..units import format_bytes

        parts = [f"{TERM_NAMES[k]} {format_bytes(v)}" for k, v in asdict(self).items() if v and k in TERM_NAMES]
        if self.nvme_state:
            parts.append(f"(on NVMe: state files {format_bytes(self.nvme_state)})")
        return ", ".join(parts) or "nothing"


@dataclass
class Unit:
    """A group of parameters stored together: a streamed layer (or the streamed embedding / head) or the resident
    parameters. ``tensors``: ``[(numel, dtype, trainable)]``."""

    tensors: list[tuple[int, torch.dtype, bool]]
    streamed: bool
    plan_resident: bool = False  # a streamed layer the plan keeps on the device (dedicated slot)
    kind: str = ""
    key: int | None = None  # the host-store key (decoder layer index, -1 embedding, num_layers head)
    # elements of a trainable embedding weight the lm_head shares (tied), held by this unit: autograd sums its two
    # gradients (the lm_head's, waiting, and the lookup's) into a third tensor before they reach the executor
    tied_numel: int = 0
    tied_dtype: torch.dtype = torch.float32
    on_disk: bool = False  # a streamed unit read from disk (`lazytrain_hf.from_pretrained`)


def optimizer_state_bytes(
    numels: list[int], hybrid_8bit: bool = True, block_size: int = DEFAULT_BLOCK_SIZE, min_8bit_size: int = 4096
) -> int:
    """Optimizer-state bytes of tensors of ``numels`` elements, as `HybridAdamW8bit.state_bytes` counts them."""
    total = 0
    for n in numels:
        if hybrid_8bit and n >= min_8bit_size:
            total += 2 * (n + 4 * math.ceil(n / block_size))
        else:
            total += 2 * 4 * n
    return total


def host_footprint(
    units: list[Unit],
    *,
    compute_dtype: torch.dtype | None = None,
    device_type: str = "cuda",
    hybrid_8bit: bool = True,
    block_size: int = DEFAULT_BLOCK_SIZE,
    min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE,
    gradient_accumulation_steps: int = 1,
    pinned_activation_bytes: int = 0,
    pool_slots: dict[str, int] | None = None,
    state_nvme: set[int] | frozenset[int] = frozenset(),
    world: World | None = None,
    rank: int = 0,
    dp_reduce_every: str = "micro_batch",
) -> HostFootprint:
    """Every term of the run's host footprint (module docstring) for parameters grouped as ``units``: with
    ``world`` of several ranks, rank ``rank``'s terms and the node's ``shared`` compute copy.

    Args:
        units: the streamed units and the resident parameters (`units_of_model`, or counts for a config).
        compute_dtype: the compute copy's dtype for fp32 parameters when it is not their own (``bf16=True``).
        device_type: ``"cuda"`` or ``"cpu"``; on a CPU device, device memory (resident parameters, their gradients,
            slots) is host memory and counted too.
        hybrid_8bit, block_size, min_8bit_size: the optimizer and its 8-bit state layout.
        gradient_accumulation_steps: above 1, gradient staging is needed.
        pinned_activation_bytes: the plan's pinned activation buffers.
        pool_slots: per layer kind, the number of slots of its pool (CPU device only; `slot_pool_sizes`).
        state_nvme: keys of the streamed units whose state is on NVMe (``Unit.key``).
        world, rank: the data-parallel world (default: one rank) and the rank whose terms these are.
        dp_reduce_every: the plan's (`Plan.dp_reduce_every`): ``"step"`` holds an fp32 accumulator of every unit
            another rank owns (``step_grads``) instead of the reduce staging.
    """
    from .layouts import CHUNK_ELEMS, IO_ALIGN, state_file_bytes  # here: tests set a smaller CHUNK_ELEMS

    win_compute: list[int] = []  # per unit on NVMe: its compute-copy window, its gradient window
    win_grad: list[int] = []
    chunk = 0
    fp = HostFootprint(activations=int(pinned_activation_bytes))
    cpu = device_type == "cpu"
    max_unit, max_grad_compute, transient = 0, 0, 0
    staged = False  # a streamed gradient crosses in a dtype other than its fp32 accumulator's
    slot_bytes: dict[str, int] = {}
    owner = unit_owner_map(units, world)
    multi = world is not None and world.world_size > 1
    sent: list[int] = []  # fp32 gradient bytes of the streamed units another rank owns
    for u in units:
        trainable = [n for n, _, t in u.tensors if t]
        in_compute = lay_dtypes(u.tensors, compute_dtype)
        mine = not u.streamed or owner.get(u.key, rank) in (rank, -1)  # a frozen unit has no owner: no state
        if mine:
            fp.optimizer += optimizer_state_bytes(trainable, hybrid_8bit, block_size, min_8bit_size)
        if u.streamed:
            lay = layer_layout(u.tensors, compute_dtype)
            if not mine and multi and dp_reduce_every == "step" and lay.train_elems:
                fp.step_grads += 4 * lay.train_elems  # registered by themselves, as the reduce staging
            elif not mine:
                sent.append(4 * lay.train_elems)
            if not mine:
                if u.key in state_nvme:
                    win_compute.append(lay.compute_bytes + 2 * IO_ALIGN)  # its fetches read the compute copy
                else:
                    fp.shared += lay.compute_bytes
            elif u.key in state_nvme:  # its state is in its file: only its windows and small fp32 moments stay
                small = [n for n, _, t in u.tensors if t and not (hybrid_8bit and n >= min_8bit_size)]
                fp.optimizer -= optimizer_state_bytes(trainable, hybrid_8bit, block_size, min_8bit_size)
                fp.optimizer += 8 * sum(small)
                fp.nvme_state += state_file_bytes(
                    u.tensors, lay.compute_bytes, lay.train_elems, block_size, min_8bit_size
                )
                win_compute.append(lay.compute_bytes + 2 * IO_ALIGN)
                win_grad.append(4 * lay.train_elems + 2 * IO_ALIGN)
                big = max([n for n in trainable if n not in small] or [0])
                c = min(CHUNK_ELEMS, max(big, max(small or [0])))
                chunk = max(chunk, c * 10 + 8 * -(-c // block_size) + 8 * IO_ALIGN)
            elif multi:  # its state on this rank, its compute copy in the node's shared memory
                fp.shared += lay.compute_bytes
                fp.masters += lay.master_bytes
                fp.grads += lay.grad_bytes
                fp.pinned_store += align_up(lay.grad_bytes)
            else:
                fp.compute += lay.compute_bytes
                fp.masters += lay.master_bytes
                fp.grads += lay.grad_bytes
                fp.pinned_store += align_up(lay.compute_bytes) + align_up(lay.grad_bytes)
            if not u.on_disk:
                # Note: [A frozen parameter keeps its own values] (streaming/store.py): the original of a frozen
                # parameter whose compute copy is rounded stays on the host (beside the node's shared copy)
                kept = [n * d.itemsize for (n, d, t), (_, cd, _) in zip(u.tensors, in_compute) if not t and cd != d]
                if multi:
                    fp.shared += sum(kept)
                else:
                    fp.masters += sum(kept)
            max_unit = max(max_unit, lay.compute_bytes)
            max_grad_compute = max(max_grad_compute, sum(n * d.itemsize for n, d, t in in_compute if t))
            staged |= any(t and d != torch.float32 for _, d, t in in_compute)
            if cpu:
                nb = align_up(lay.compute_bytes, ALIGN_BYTES)
                if u.plan_resident:
                    fp.device_on_host += nb  # its dedicated slot
                elif u.kind in ("embed", "head"):
                    transient = max(transient, nb)  # Note: [Transient slots are stream-ordered allocations]
                else:
                    slot_bytes[u.kind] = max(slot_bytes.get(u.kind, 0), nb)
            continue
        # resident parameters (streaming/binder.py phase 3; training/updater.py's masters)
        for (n, dt, t), (_, cdt, _) in zip(u.tensors, in_compute):
            cast = cdt != dt  # Note: [A bf16 compute copy of an fp32 model]: the fp32 original stays on the host
            if cast:
                fp.masters += 4 * n
            elif t and not (cpu and dt == torch.float32):
                fp.masters += 4 * n  # an fp32 host master (an fp32 CPU parameter is its own master)
            if t and (cast or not (cpu and dt == torch.float32)):
                fp.resident += 4 * n  # the fp32 host copy of its gradient the optimizer takes at each step
            if cpu:
                fp.device_on_host += n * cdt.itemsize * (2 if t else 1)  # the parameter and its .grad
            max_unit = max(max_unit, n * cdt.itemsize)
    if cpu and pool_slots:
        fp.device_on_host += sum(slot_bytes.get(k, 0) * c for k, c in pool_slots.items())
    if cpu:
        for u in units:
            if u.tied_numel:  # the tied embedding's two summed gradients, in the compute dtype
                cdt = lay_dtypes([(u.tied_numel, u.tied_dtype, True)], compute_dtype)[0][1]
                fp.device_on_host += 2 * u.tied_numel * cdt.itemsize
        fp.device_on_host += transient  # one streamed embedding / head unit bound at a time
        fp.device_on_host += max_grad_compute  # one layer's device gradients until they reach the accumulators
    if gradient_accumulation_steps > 1 or staged:
        fp.staging = GRAD_STAGING_LAYERS * max_grad_compute
    fp.checkpoint = max_unit
    fp.reduce_staging = sum(sorted(sent, reverse=True)[:REDUCE_STAGING_UNITS])
    if win_grad or win_compute:
        fp.state_windows = (
            # windows of different units, the largest ones: fetches in flight all step; in backward the gradients
            # in flight, while the next forward runs the optimizer's (its compute window and chunks): the backward
            # only starts once every unit is updated (Note: [Update before fetch] in training/updater.py)
            sum(sorted(win_compute, reverse=True)[:STATE_FETCH_WINDOWS])
            + max(
                sum(sorted(win_grad, reverse=True)[:STATE_GRAD_WINDOWS]),
                (max(win_compute) + STATE_CHUNK_WINDOWS * chunk) if win_grad else 0,
            )
        )
    return fp


def unit_owner_map(units: list[Unit], world: World | None) -> dict[int, int]:
    """``{unit key: owner rank}`` of the streamed ``units`` (`units_of_model`) in ``world`` (empty for one rank):
    dealt in unit order (embedding ``-1``, layers, head ``L``: the keys' order) by their trainable elements (numels
    summed), as `lazytrain_hf.planner.world.unit_owners` deals them; the executor's partition is this one."""
    if world is None or world.world_size == 1:
        return {}
    streamed = sorted((u for u in units if u.streamed and u.key is not None), key=lambda u: u.key)
    elems = [sum(n for n, _, t in u.tensors if t) for u in streamed]
    return {u.key: o for u, o in zip(streamed, unit_owners(elems, world.world_size))}


@dataclass
class WorldFootprint:
    """The host footprint of a data-parallel world: each rank's terms (`HostFootprint`, its ``shared`` the node's
    compute copy) and per node the shared copy once plus the terms of its ranks.

    ``total``, ``save_peak`` and ``activations`` are the largest node's, so `place_state` and the budget arithmetic
    of one rank work unchanged on a world (a budget is then per node)."""

    world: World
    ranks: list[HostFootprint]

    @property
    def shared(self) -> int:
        return self.ranks[0].shared

    def node_ranks(self, node: int) -> list[HostFootprint]:
        k = self.world.local_world_size
        return self.ranks[node * k : (node + 1) * k]

    def node_total(self, node: int) -> int:
        """Peak host bytes of ``node`` over a training step: its shared copy once plus its ranks' totals."""
        return self.shared + sum(fp.total for fp in self.node_ranks(node))

    def node_save_peak(self, node: int) -> int:
        return self.shared + sum(fp.save_peak for fp in self.node_ranks(node))

    def node_peak(self, node: int) -> int:
        return max(self.node_total(node), self.node_save_peak(node))

    @property
    def total(self) -> int:
        return max(self.node_total(n) for n in range(self.world.nodes))

    @property
    def save_peak(self) -> int:
        return max(self.node_save_peak(n) for n in range(self.world.nodes))

    @property
    def activations(self) -> int:
        return max(sum(fp.activations for fp in self.node_ranks(n)) for n in range(self.world.nodes))

    @property
    def nvme_state(self) -> int:
        """Bytes of the state files of the largest node's ranks (each rank's files hold its own units)."""
        return max(sum(fp.nvme_state for fp in self.node_ranks(n)) for n in range(self.world.nodes))

    def describe(self) -> str:
        from ..units import format_bytes

        node = max(range(self.world.nodes), key=self.node_peak)
        ranks = "; ".join(
            f"rank {node * self.world.local_world_size + j}: {fp.describe()}"
            for j, fp in enumerate(self.node_ranks(node))
        )
        return f"node {node}: {format_bytes(self.node_peak(node))} = shared compute copy {format_bytes(self.shared)} + {ranks}"


def world_footprint(units: list[Unit], world: World, **kwargs) -> WorldFootprint:
    """`host_footprint` of every rank of ``world`` (``kwargs``: its other arguments)."""
    return WorldFootprint(
        world, [host_footprint(units, world=world, rank=r, **kwargs) for r in range(world.world_size)]
    )


def rank_activation_budget(node_budget: int, wf: WorldFootprint | HostFootprint) -> int:
    """Pinned activation bytes each rank may plan for so that every node fits ``node_budget`` bytes of host RAM: what
    the node's shared copy and its ranks' other terms (at their peak) leave, divided among its ranks. With one rank
    (a `HostFootprint`): the budget less the footprint's peak without its activations."""
    if isinstance(wf, HostFootprint):
        return max(0, int(node_budget) - (max(wf.total, wf.save_peak) - wf.activations))
    k = wf.world.local_world_size
    left = []
    for n in range(wf.world.nodes):
        acts = sum(fp.activations for fp in wf.node_ranks(n))
        left.append((int(node_budget) - (wf.node_peak(n) - acts)) // k)
    return max(0, min(left))


def lay_dtypes(
    tensors: list[tuple[int, torch.dtype, bool]], compute_dtype: torch.dtype | None
) -> list[tuple[int, torch.dtype, bool]]:
    """``tensors`` with each dtype replaced by its compute dtype."""
    return [(n, compute_dtype if compute_dtype is not None and d == torch.float32 else d, t) for n, d, t in tensors]


# ---------------------------------------------------------------------- from a model and a plan
def units_of_model(model: torch.nn.Module, plan) -> list[Unit]:
    """The parameters of ``model`` grouped as the executor stores them under ``plan`` (streaming/binder.py's split:
    a layer's trainable parameters stay resident when they are under `RESIDENT_TRAINABLE_FRACTION` of a partly
    frozen layer; with ``plan.stream_embeddings`` the embedding and final norm + lm_head are units too, a tied
    lm_head belonging to the embedding)."""
    from .. import models
    from .layouts import hf_root, streamed_parameters

    root = hf_root(model)
    layers = models.decoder_layers(root)
    units: list[Unit] = []
    seen: set[int] = set()
    lps = plan.layers if plan is not None else [None] * len(layers)
    for key, (layer, lp) in enumerate(zip(layers, lps)):
        params = list(layer.parameters())
        streamed = streamed_parameters(params)
        seen.update(id(p) for p in streamed)
        if streamed:
            units.append(
                Unit(
                    [(p.numel(), p.dtype, p.requires_grad) for p in streamed],
                    True,
                    bool(lp is not None and lp.resident),
                    lp.kind if lp is not None else "",
                    key,
                    on_disk=any(p.device.type == "meta" for p in streamed),  # attach reads meta ones from disk
                )
            )
    embed, norm, head = models.embed_tokens(root), models.final_norm(root), models.lm_head(root)
    e = list(embed.parameters())
    ids = {id(p) for p in e}
    tied = [p for p in head.parameters() if id(p) in ids and p.requires_grad]
    tied_numel = tied[0].numel() if tied else 0
    tied_dtype = tied[0].dtype if tied else torch.float32
    if plan is not None and plan.stream_embeddings:
        h = list(norm.parameters()) + [p for p in head.parameters() if id(p) not in ids]
        for ps, kind, key in ((e, "embed", -1), (h, "head", len(layers))):
            if ps:
                seen.update(id(p) for p in ps)
                units.append(
                    Unit(
                        [(p.numel(), p.dtype, p.requires_grad) for p in ps],
                        True,
                        False,
                        kind,
                        key,
                        tied_numel if kind == "embed" else 0,
                        tied_dtype,
                    )
                )
        tied_numel = 0
    rest = [p for p in _unique_parameters(model) if id(p) not in seen]
    units.append(
        Unit(
            [(p.numel(), p.dtype, p.requires_grad) for p in rest], False, tied_numel=tied_numel, tied_dtype=tied_dtype
        )
    )
    return units


def _unique_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    out, ids = [], set()
    for p in model.parameters():
        if id(p) not in ids:
            ids.add(id(p))
            out.append(p)
    return out


def slot_pool_sizes(plan, units: list[Unit]) -> dict[str, int]:
    """Slots per pool kind as the binder sizes them (streaming/binder.py, phase 2), for the CPU-device term."""
    if plan is None:
        return {}
    by_kind: dict[str, list] = {}
    for u, lp in zip([u for u in units if u.streamed and u.kind not in ("embed", "head")], plan.layers):
        if not u.plan_resident:
            by_kind.setdefault(u.kind, []).append(lp)
    out = {}
    for kind, lps in by_kind.items():
        depth = max(max(lp.fetch_fwd_ahead, lp.fetch_bwd_ahead) for lp in lps)
        bwd_depth = max(lp.fetch_bwd_ahead for lp in lps)
        extra = min(2, max(0, plan.checkpoint_every - 1 - bwd_depth))
        out[kind] = min(len(lps), max(1, depth) + 1 + extra)
    return out


def run_footprint(
    model: torch.nn.Module,
    plan,
    *,
    compute_dtype: torch.dtype | None = None,
    device: str | torch.device = "cuda",
    hybrid_8bit: bool = True,
    block_size: int = DEFAULT_BLOCK_SIZE,
    min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE,
    gradient_accumulation_steps: int = 1,
    rank: int = 0,
) -> HostFootprint:
    """`host_footprint` of training ``model`` streamed with ``plan`` (parameters may be meta: only shapes, dtypes
    and ``requires_grad`` are read), on rank ``rank`` of the plan's world: in a world of several ranks the rank's
    own terms, without the node's shared compute copy (``shared``); a node's whole footprint is
    `world_run_footprint`'s."""
    units = units_of_model(model, plan)
    device_type = torch.device(device).type
    pinned = int((plan.predicted or {}).get("pinned_host_bytes", 0) or 0) if plan is not None else 0
    return host_footprint(
        units,
        compute_dtype=compute_dtype,
        device_type=device_type,
        hybrid_8bit=hybrid_8bit,
        block_size=block_size,
        min_8bit_size=min_8bit_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        pinned_activation_bytes=pinned,
        pool_slots=slot_pool_sizes(plan, units) if device_type == "cpu" else None,
        state_nvme=frozenset(plan.state_nvme) if plan is not None else frozenset(),
        world=plan.world if plan is not None else None,
        rank=rank,
        dp_reduce_every=getattr(plan, "dp_reduce_every", "micro_batch"),
    )


def world_run_footprint(model: torch.nn.Module, plan, **kwargs) -> WorldFootprint:
    """`run_footprint` of every rank of ``plan``'s world (``kwargs``: its other arguments): what the host budget of a
    node is checked against (`WorldFootprint.node_peak`, `rank_activation_budget`)."""
    world = plan.world
    return WorldFootprint(world, [run_footprint(model, plan, rank=r, **kwargs) for r in range(world.world_size)])


def spill_order(plan, units: list[Unit]) -> list[int]:
    """The streamed units a growing state on NVMe takes, in order: the head, then decoder layers from the last
    (their optimizer updates come last in the layer-wise pass, so their state I/O has the longest stretch of the
    next forward to overlap), the embedding last; never a layer the plan keeps resident."""
    keys = [u.key for u in units if u.streamed and not u.plan_resident and u.key is not None]
    L = plan.num_layers
    head = [k for k in keys if k == L]
    layers = sorted((k for k in keys if 0 <= k < L), reverse=True)
    embed = [k for k in keys if k == -1]
    return head + layers + embed


def place_state(plan, units: list[Unit], budget: int | None, footprint, everything: bool = False) -> list[int]:
    """The fewest units (in `spill_order`) whose state must go to NVMe for ``footprint(keys)`` (a
    `HostFootprint`) to fit ``budget`` bytes at its peak (``max(total, save_peak)``); every candidate with
    ``everything``. Returns the sorted keys; all candidates when even they do not fit (the host check then says so).
    """
    order = spill_order(plan, units)
    if everything:
        return sorted(order)

    def need(keys: list[int]) -> int:
        fp = footprint(frozenset(keys))
        return max(fp.total, fp.save_peak)

    if budget is None or need([]) <= budget:
        return []
    lo, hi = 1, len(order)  # the footprint shrinks as units go (past the windows of the first one): bisect
    if need(order) > budget:
        return sorted(order)
    while lo < hi:
        mid = (lo + hi) // 2
        if need(order[:mid]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return sorted(order[:lo])


def counts_footprint(layer_params: list[int], embed_params: int, head_params: int, dtype_bytes: int) -> HostFootprint:
    """`host_footprint` from parameter counts (the cost model, no weights): every parameter trainable, each decoder
    layer one tensor, the embedding and the head resident on a CUDA device, gradient accumulation on (staging
    counted). Per-tensor 8-bit thresholds and alignment padding are below 0.1% of a real model's state."""
    dt = torch.float32 if dtype_bytes == 4 else torch.bfloat16
    units = [Unit([(n, dt, True)], True, key=i) for i, n in enumerate(layer_params)]
    units.append(Unit([(n, dt, True) for n in (embed_params, head_params) if n], False))
    return host_footprint(units, gradient_accumulation_steps=2)


def counts_world_footprint(
    layer_params: list[int],
    embed_params: int,
    head_params: int,
    dtype_bytes: int,
    world: World,
    dp_reduce_every: str = "micro_batch",
) -> WorldFootprint:
    """`counts_footprint` on every rank of ``world``: each decoder layer a unit owned by one rank, the embedding
    and head resident on every rank; ``dp_reduce_every``: the plan's (``"step"``: `HostFootprint.step_grads`)."""
    dt = torch.float32 if dtype_bytes == 4 else torch.bfloat16
    units = [Unit([(n, dt, True)], True, key=i) for i, n in enumerate(layer_params)]
    units.append(Unit([(n, dt, True) for n in (embed_params, head_params) if n], False))
    return world_footprint(units, world, gradient_accumulation_steps=2, dp_reduce_every=dp_reduce_every)
