"""Data parallel of a streamed model: the training state partitioned by unit across the ranks, and the collectives.

`LazyTrainer` with ``world_size > 1`` hands the executor the owner of each streamed unit (`unit_owners_of`, dealt by
`lazytrain_hf.planner.world.unit_owners` over the planner's own unit list in unit order) and builds a
`PartitionedDataParallel`, which owns the collectives of a step:

- a unit's gradients summed into its owner's accumulator (`reduce_to_owner`, every micro-batch, on the executor's
  worker thread: Note: [Partitioned gradients are reduced to their owner every micro-batch] in
  streaming/gradients.py);
- the global gradient norm from the per-unit squared norms, each known only on its owner (`global_grad_norm`: Note:
  [The global norm of a partitioned state]);
- the resident parameters' device gradients averaged over the ranks (`reduce_resident`; every rank updates them);
- an updated unit's compute copy sent from its owner to the other ranks (`send_compute` / `receive_compute`, on the
  updater's thread: Note: [A unit's new compute copy reaches every rank after its owner's update]);
- at the end of training, the fp32 masters a rank needs to give its model back (`gather_masters`).

Each runs on its own gloo group, created collectively here, so that no two threads of a rank share one group.
"""

from __future__ import annotations

import datetime
import math
import os
from typing import Any

import torch

from ..planner import hostmem
from ..planner.world import World, unit_owners
from ..streaming.nodecopy import dp_timeout_s


def all_reduce_mean(grads: list[torch.Tensor], group: Any = None) -> None:
    """Average ``grads`` over the data-parallel ranks in place, in fp32.

    Large fp32 tensors are reduced where they are (no copy); the others (bf16 gradients, small fp32 ones such as
    norms and adapters) go through one fp32 buffer, which is the upcast of a bf16 one, reduced in one call and
    copied back: a bf16 result is the rank mean within one rounding of bf16 (``2^-8`` relative)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    in_place = [g.dtype == torch.float32 and (len(grads) == 1 or g.numel() >= 1 << 16) for g in grads]
    low = [g for g, keep in zip(grads, in_place) if not keep]
    for g, keep in zip(grads, in_place):
        if keep:
            dist.all_reduce(g, group=group)
            g.div_(world)
    if low:
        flat = torch.empty(sum(g.numel() for g in low), dtype=torch.float32, device=low[0].device)
        offset = 0
        for g in low:
            flat[offset : offset + g.numel()].copy_(g.reshape(-1))
            offset += g.numel()
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        offset = 0
        for g in low:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def unit_owners_of(model: torch.nn.Module, plan, world_size: int) -> dict[int, int]:
    """``{unit key: owner rank}`` of the streamed units of ``model`` under ``plan`` (Note: [The training state is
    partitioned by unit] in planner/world.py): the units are the planner's (`hostmem.units_of_model`, the executor's
    split) in unit order (embedding unit if streamed, decoder layers 0..L-1, head unit if streamed: ascending
    host-store keys), each weighed by its trainable elements."""
    units = sorted((u for u in hostmem.units_of_model(model, plan) if u.streamed), key=lambda u: u.key)
    elems = [sum(n for n, _, trainable in u.tensors if trainable) for u in units]
    return dict(zip((u.key for u in units), unit_owners(elems, world_size)))


class PartitionedDataParallel:
    """The collectives of a streamed run whose training state is partitioned by unit (see the module docstring).

    Args:
        handle: the attached `StreamHandle`, built with ``unit_owners`` and this process's ``rank``.
        world_size: ranks in all; ``local_world_size``: ranks per node (``LOCAL_WORLD_SIZE`` of
            `torch.distributed.run` by default).
    """

    def __init__(self, handle, world_size: int, rank: int, local_world_size: int | None = None):
        import torch.distributed as dist

        local = int(local_world_size or os.environ.get("LOCAL_WORLD_SIZE", world_size))
        self.world = World(world_size, max(1, world_size // max(1, local)))
        self.rank = int(rank)
        self.owners = dict(handle.unit_owners)
        self.unit_keys = sorted(self.owners)
        # one gloo group per thread that runs collectives: the executor's worker (gradient reduces), the updater's
        # thread (compute copies), the training thread (norms); created in the same order on every rank
        # Note: [A failed rank is named] (training/partitions.py): a collective blocked on a silent rank ends
        timeout = datetime.timedelta(seconds=dp_timeout_s())
        self.grad_group = dist.new_group(backend="gloo", timeout=timeout)
        self.compute_group = dist.new_group(backend="gloo", timeout=timeout)
        self.norm_group = dist.new_group(backend="gloo", timeout=timeout)
        self.reductions: dict[int, int] = {}  # unit -> reduces this rank took part in (read by tests)
        self.received: dict[int, int] = {}  # unit -> compute copies received
        self.resident_reductions = 0
        handle.owner_grad_reducer = self.reduce_to_owner

    def __repr__(self) -> str:
        mine = [k for k in self.unit_keys if self.owners[k] == self.rank]
        return f"PartitionedDataParallel(rank={self.rank}, {self.world}, owned units={mine})"

    # ------------------------------------------------------------------ gradients
    def reduce_to_owner(self, unit: int, flat: torch.Tensor, owner: int, last: bool) -> None:
        """Sum every rank's ``flat`` into the owner's; at the last micro-batch the owner divides by the world size
        (the mean over ranks, as the all-reduce it replaces). Note: [Partitioned gradients are reduced to their
        owner every micro-batch] in streaming/gradients.py."""
        import torch.distributed as dist

        dist.reduce(flat, dst=owner, op=dist.ReduceOp.SUM, group=self.grad_group)
        if last and owner == self.rank:
            flat.div_(self.world.world_size)
        self.reductions[unit] = self.reductions.get(unit, 0) + 1

    def reduce_resident(self, handle) -> None:
        """The resident parameters' device gradients averaged over the ranks (once per optimizer step, before the
        norm; on the training thread's group, ``norm_group``): every rank then updates them identically."""
        grads = [p.grad for _, p in handle.resident_parameters() if p.grad is not None]
        if grads:
            all_reduce_mean(grads, group=self.norm_group)  # the training thread's group, with its timeout
        self.resident_reductions += 1

    def global_grad_norm(self, handle) -> float:
        """Note: [The global norm of a partitioned state]
        A unit's squared norm is known on its owner only. The per-unit squared norms go into one float64 vector in
        unit order, zeros for units this rank does not own, all-reduced (sum): each entry has exactly one non-zero
        contributor, so the sum is exact and every rank gets the same vector; it is then summed in unit order, the
        resident parameters' squared norm (taken after their all-reduce, the same on every rank) added last. The
        norm is therefore identical, bit for bit, on every rank, and so are the clip coefficient and the decision to
        skip a non-finite step."""
        import torch.distributed as dist

        sq = handle.grad_sq_norms()
        vec = torch.tensor([float(sq.get(k, 0.0)) for k in self.unit_keys], dtype=torch.float64)
        dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.norm_group)
        total = 0.0
        for x in vec.tolist():
            total += x
        return math.sqrt(total + float(sq.get("resident", 0.0)))

    # ------------------------------------------------------------------ compute copies
    def send_compute(self, handle, unit: int) -> None:
        """The owner's half of `receive_compute`: its updated compute copy to every other rank."""
        import torch.distributed as dist

        spill = handle.nvme_state
        if spill is not None and unit in spill.units:
            src = spill.read_compute(unit, "broadcast")  # the compute copy lives in the unit's file
            try:
                dist.broadcast(src, src=self.rank, group=self.compute_group)
            finally:
                spill.hold(None, src)
            return
        dist.broadcast(handle.store.layers[unit].compute_bytes, src=self.rank, group=self.compute_group)

    def receive_compute(self, handle, unit: int, step: int) -> None:
        """Note: [A unit's new compute copy reaches every rank after its owner's update]
        Each rank holds a compute copy of every unit; only the owner updates a unit (its masters and moments are
        there). The updater of every rank walks the units in unit order: the owner updates the unit and broadcasts
        its new compute copy (`send_compute`), every other rank receives it here into its own copy, after the
        fetches still reading the old one (`TransferEngine.wait_host_reads`), refreshes a plan-resident unit's slot
        and only then marks the unit updated, so its next fetch waits for the new weights (Note: [Update before
        fetch] in training/updater.py). A rank only ever writes its own copy, so no rank's write races another's
        fetch. The ordering that would matter for one copy per node (the owner writing step s + 1's weights while
        another rank still fetches step s's) holds as well: the owner updates a unit after the global norm, which
        needs every unit's gradient reduce, and a rank enters a unit's reduce only once the unit's backward is
        complete, i.e. after its last fetch of the unit for that step was consumed (a unit fetched twice, the
        backward re-fetch or the tied embedding that the head binds again, completes after both uses: Note:
        [Streamed embeddings and head] in streaming/units.py). Bytes received from an owner on another node are
        recorded in the trace on the lane ``net`` as ``gather`` (the unit's compute-copy bytes, once per step); on
        one node they are not (the planned layout shares one copy per node). Tests: ``tests/test_trainer_ddp.py``.
        """
        import torch.distributed as dist

        ls = handle.store.layers[unit]
        owner = self.owners[unit]
        handle.engine.wait_host_reads(unit)  # Note: [Host compute copy is not rewritten while a fetch reads it]
        dist.broadcast(ls.compute_bytes, src=owner, group=self.compute_group)
        if self.world.node_of(owner) != self.world.node_of(self.rank):
            handle.trace.transfer("net", ls.compute_bytes.numel(), "uint8", unit, "gather", step=step)
        handle.sync_compute(unit, compute_written=True)  # a plan-resident unit's slot re-uploaded
        self.received[unit] = self.received.get(unit, 0) + 1

    # ------------------------------------------------------------------ end of training
    def gather_masters(self, handle, updater) -> None:
        """Give every rank the fp32 masters of the units it does not own whose compute copy is in another dtype (a
        bf16 compute copy of an fp32 model), so `StreamHandle.remove()` gives every parameter its fp32 value as on
        one process (Note: [A bf16 compute copy of an fp32 model] in streaming/hooks.py). Called on every rank, in
        unit order, after the last update; nothing to do when every compute copy is the masters' dtype."""
        import torch.distributed as dist

        updater.wait_all()
        for unit in self.unit_keys:
            ls = handle.store.layers.get(unit)
            if ls is None or not any(e.trainable and e.orig_dtype is not None for e in ls.entries):
                continue
            n = ls.layout.train_elems
            owner = self.owners[unit]
            spill = handle.nvme_state
            if owner == self.rank and spill is not None and unit in spill.units:
                flat = torch.zeros(n, dtype=torch.float32)  # the masters live in the unit's file
                for e in ls.trainable_entries:
                    flat.narrow(0, e.elem_offset, e.numel).copy_(spill.read_param(unit, e.name, "master").reshape(-1))
            elif owner == self.rank:
                flat = ls.master
            else:
                flat = torch.zeros(n, dtype=torch.float32)
            dist.broadcast(flat, src=owner, group=self.compute_group)
            if owner != self.rank:
                ls.master = flat
                ls.master_views = {
                    e.name: flat.narrow(0, e.elem_offset, e.numel).view(e.shape) for e in ls.trainable_entries
                }
