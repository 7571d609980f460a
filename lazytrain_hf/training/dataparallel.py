"""Data parallel of a streamed model: the training state partitioned by unit across the ranks, and the collectives.

`LazyTrainer` with ``world_size > 1`` hands the executor the owner of each streamed unit (`unit_owners_of`, dealt by
`lazytrain_hf.planner.world.unit_owners` over the planner's own unit list in unit order) and builds a
`PartitionedDataParallel`, which owns the collectives of a step:

- a unit's gradients summed into its owner's accumulator (`reduce_to_owner`, every micro-batch, on the executor's
  worker thread: Note: [Partitioned gradients are reduced to their owner every micro-batch] in
  streaming/gradients.py; with the plan's ``dp_reduce_every == "step"`` once per step, from each rank's own
  accumulator of the unit: Note: [Gradients reduced once per step]), or, with the plan's ``dp_reduce == "device"``, into the owner's device gradients before
  its D2H copy (`reduce_on_device`, on the thread that runs the backward: Note: [Gradients reduced on the device skip
  the other ranks' D2H]);
- the global gradient norm from the per-unit squared norms, each known only on its owner (`global_grad_norm`: Note:
  [The global norm of a partitioned state]);
- the resident parameters' device gradients averaged over the ranks (`reduce_resident`; every rank updates them);
- the node's compute copy, shared by its ranks (a `NodeCopy`): an updated unit's new version published by its owner,
  waited for by the other local ranks, sent to the other nodes (`send_compute` / `receive_compute`, on the updater's
  thread: Note: [The node's compute copy is shared by its ranks]);
- with a compute copy in another dtype (bf16 of an fp32 model), the node's segment of fp32 masters, where each
  owner's masters live (Note: [Masters live in the node's segment]), and at the end of training the masters every
  rank's model is given back (`gather_masters`).

Each runs on its own gloo group, created collectively here, so that no two threads of a rank share one group.
"""

from __future__ import annotations

import datetime
import math
import os
import uuid
from typing import Any

import torch

from ..planner import hostmem
from ..planner.layouts import ALIGN_BYTES, align_up, layer_layout
from ..planner.world import World, unit_owners
from ..streaming.nodecopy import NodeCopy, dp_timeout_s


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


def masters_elems(model: torch.nn.Module, plan, compute_dtype: torch.dtype | None) -> dict[int, int]:
    """``{unit key: fp32 master elements}`` of the streamed units whose trainable fp32 parameters have their compute
    copy in ``compute_dtype`` (a bf16 compute copy of an fp32 model): the node's segment of masters (Note: [Masters
    live in the node's segment]); empty when every compute copy is its masters' dtype."""
    if compute_dtype is None or compute_dtype == torch.float32:
        return {}
    out = {}
    for u in hostmem.units_of_model(model, plan):
        if u.streamed and any(trainable and dt == torch.float32 for _, dt, trainable in u.tensors):
            out[u.key] = layer_layout(u.tensors, compute_dtype).train_elems
    return out


def node_copy_bytes(model: torch.nn.Module, plan, compute_dtype: torch.dtype | None) -> int:
    """Bytes of the node copy: every streamed unit's compute copy as the host store lays it out (`layer_layout`),
    each at an `ALIGN_BYTES` boundary."""
    units = [u for u in hostmem.units_of_model(model, plan) if u.streamed]
    return sum(align_up(layer_layout(u.tensors, compute_dtype).compute_bytes, ALIGN_BYTES) for u in units)


class PartitionedDataParallel:
    """The collectives of a streamed run whose training state is partitioned by unit (see the module docstring), and
    the node's shared compute copy (Note: [The node's compute copy is shared by its ranks]).

    Built on every rank before the executor is attached (the `NodeCopy` the host store carves its compute copies
    from is created collectively here), then `bind` to the attached `StreamHandle`; `close` after it was removed.

    Args:
        world_size / rank: ranks in all, this process's; ``owners``: `unit_owners_of`.
        data_nbytes: bytes of every unit's compute copy (`node_copy_bytes`); ``pin``: page-lock the node copy.
        local_world_size: ranks per node (``LOCAL_WORLD_SIZE`` of `torch.distributed.run` by default).
        dp_reduce: the plan's ``dp_reduce``; ``"device"`` creates the device group (`reduce_on_device`) on
            ``device``: NCCL on CUDA, gloo on the CPU device.
        dp_reduce_every: the plan's ``dp_reduce_every`` (``"micro_batch"`` or ``"step"``), handed to the executor by
            `bind` (Note: [Gradients reduced once per step] in streaming/gradients.py).
        masters: `masters_elems`: the node's segment of fp32 masters is created with the node copy (none: at the
            end of training, by `gather_masters`, where a unit needs it).
    """

    def __init__(
        self,
        world_size: int,
        rank: int,
        owners: dict[int, int],
        data_nbytes: int,
        pin: bool = False,
        local_world_size: int | None = None,
        dp_reduce: str = "host",
        device: torch.device | str = "cpu",
        dp_reduce_every: str = "micro_batch",
        masters: dict[int, int] | None = None,
    ):
        import torch.distributed as dist

        if dp_reduce_every not in ("micro_batch", "step") or (dp_reduce_every == "step" and dp_reduce == "device"):
            raise ValueError(
                f"dp_reduce_every={dp_reduce_every!r} with dp_reduce={dp_reduce!r}: pass 'micro_batch', or 'step' "
                "with dp_reduce='host' (gradients reduced once per step are accumulated on the host)."
            )
        self.dp_reduce_every = dp_reduce_every

        local = int(local_world_size or os.environ.get("LOCAL_WORLD_SIZE", world_size))
        self.world = World(world_size, max(1, world_size // max(1, local)))
        self.rank = int(rank)
        self.owners = dict(owners)
        self.unit_keys = sorted(self.owners)
        self._index = {k: j for j, k in enumerate(self.unit_keys)}  # the node copy's version slot of each unit
        # one gloo group per thread that runs collectives: the executor's worker (gradient reduces), the updater's
        # thread (compute copies), the training thread (norms, setup); created in the same order on every rank
        # Note: [A failed rank is named] (training/partitions.py): a collective blocked on a silent rank ends
        timeout = datetime.timedelta(seconds=dp_timeout_s())
        self.grad_group = dist.new_group(backend="gloo", timeout=timeout)
        self.compute_group = dist.new_group(backend="gloo", timeout=timeout)
        self.norm_group = dist.new_group(backend="gloo", timeout=timeout)
        # across nodes: one group per local rank, its ranks on every node (units owned on another node arrive there)
        self.local_groups = []
        if self.world.nodes > 1:
            lw = self.world.local_world_size
            for lr in range(lw):
                ranks = [n * lw + lr for n in range(self.world.nodes)]
                self.local_groups.append(dist.new_group(ranks, backend="gloo", timeout=timeout))
        # Note: [Gradients reduced on the device skip the other ranks' D2H]: the backward's thread's group, on the
        # devices (NCCL on CUDA; gloo on the CPU device, the same code path)
        self.device_group = None
        if dp_reduce == "device":
            backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
            if backend == "nccl" and not dist.is_nccl_available():
                raise ValueError(
                    "dp_reduce='device' on CUDA needs NCCL, which this PyTorch build lacks; pass "
                    "planner_dp_reduce='host' (gloo on the host copies) or install a CUDA build of PyTorch."
                )
            self.device_group = dist.new_group(backend=backend, timeout=timeout)
        run_id = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(run_id, src=0, group=self.norm_group)
        self.run_id = run_id[0]
        self.masters_copy: NodeCopy | None = None  # Note: [Masters live in the node's segment]
        self.node_masters: dict[int, torch.Tensor] = {}  # unit -> its fp32 masters in that segment
        self.node_copy = NodeCopy(
            run_id[0],
            self.world,
            self.rank,
            int(data_nbytes),
            len(self.unit_keys),
            lambda: dist.barrier(group=self.norm_group),
            pin,
        )
        if masters:
            try:
                self._make_masters_segment(masters)
            except BaseException:
                self.close()
                raise
        self.versions = {k: 0 for k in self.unit_keys}  # updates of each unit so far (the node copy's versions)
        self.reductions: dict[int, int] = {}  # unit -> reduces this rank took part in (read by tests)
        self.received: dict[int, int] = {}  # unit -> new compute copies of units owned elsewhere seen
        self.resident_reductions = 0

    @classmethod
    def for_run(cls, model: torch.nn.Module, plan, args, compute_dtype: torch.dtype | None) -> PartitionedDataParallel:
        """For `LazyTrainer`: ``model`` under ``plan`` on ``args.world_size`` ranks, this one ``args.process_index``."""
        from ..streams import pin_host_memory

        owners = unit_owners_of(model, plan, args.world_size)
        nbytes = node_copy_bytes(model, plan, compute_dtype)
        return cls(
            args.world_size,
            args.process_index,
            owners,
            nbytes,
            pin_host_memory(args.device),
            dp_reduce=plan.dp_reduce,
            device=args.device,
            dp_reduce_every=plan.dp_reduce_every,
            masters=masters_elems(model, plan, compute_dtype),
        )

    def attach_kwargs(self) -> dict[str, Any]:
        """What `lazytrain_hf.streaming.attach` takes to build this rank's partition of the host store."""
        return dict(unit_owners=self.owners, rank=self.rank, node_copy=self.node_copy, node_masters=self.node_masters)

    def _make_masters_segment(self, masters: dict[int, int]) -> None:
        """The node's segment of fp32 masters (collective on the node), one buffer per unit of ``masters`` in unit
        order (`node_masters`). Note: [Masters live in the node's segment]."""
        import torch.distributed as dist

        keys = sorted(masters)
        nbytes = sum(align_up(int(masters[k]) * 4) for k in keys)
        self.masters_copy = NodeCopy(
            self.run_id + "-masters",
            self.world,
            self.rank,
            nbytes,
            len(keys),
            lambda: dist.barrier(group=self.norm_group),
            False,
            "the node's fp32 masters",
        )
        self.node_masters = {k: self.masters_copy.carve(int(masters[k]), torch.float32) for k in keys}

    def __repr__(self) -> str:
        mine = [k for k in self.unit_keys if self.owners[k] == self.rank]
        return f"PartitionedDataParallel(rank={self.rank}, {self.world}, owned units={mine})"

    def bind(self, handle) -> None:
        """Send the executor's completed gradients to their owners (Note: [Partitioned gradients are reduced to their
        owner every micro-batch] in streaming/gradients.py)."""
        if self.node_masters and self._cast_units(handle) != sorted(self.node_masters):
            raise RuntimeError(  # before the first step, not at the end of training (`gather_masters`)
                f"the node's segment of masters holds units {sorted(self.node_masters)}, the host store casts "
                f"{self._cast_units(handle)} to its compute dtype (Note: [Masters live in the node's segment])."
            )
        handle.owner_grad_reducer = self.reduce_to_owner
        handle.dp_reduce_every = self.dp_reduce_every  # Note: [Gradients reduced once per step]
        if self.device_group is not None:
            handle.owner_device_reducer = self.reduce_on_device

    @staticmethod
    def _cast_units(handle) -> list[int]:
        """The host store's units whose trainable fp32 parameters have a compute copy in another dtype, in order."""
        return sorted(
            unit
            for unit, ls in handle.store.layers.items()
            if any(e.trainable and e.orig_dtype is not None for e in ls.entries)
        )

    def close(self) -> None:
        if self.node_copy is not None:
            self.node_copy.close()
            self.node_copy = None
        if self.masters_copy is not None:  # Note: [Masters live in the node's segment]
            self.masters_copy.close()
            self.masters_copy = None

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

    def reduce_on_device(self, unit: int, grads: list[torch.Tensor], owner: int) -> None:
        """Sum every rank's device gradients ``grads`` of ``unit`` into the owner's, in place, and divide the owner's
        by the world size (the rank mean of this micro-batch; the owner's accumulator sums the micro-batches). Note:
        [Gradients reduced on the device skip the other ranks' D2H] in streaming/gradients.py."""
        import torch.distributed as dist

        for g in grads:
            dist.reduce(g, dst=owner, op=dist.ReduceOp.SUM, group=self.device_group)
        if owner == self.rank:
            for g in grads:
                g.div_(self.world.world_size)
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
        """The owner's side of Note: [The node's compute copy is shared by its ranks]: its update of ``unit`` is in
        the node copy (written by the optimizer there, or, for a unit whose state is on NVMe, copied from the unit's
        file); publish the new version, then send it to the other nodes."""
        import torch.distributed as dist

        self.versions[unit] += 1
        shared = handle.store.shared_compute[unit]
        spill = handle.nvme_state
        if spill is not None and unit in spill.units:
            # the new compute copy lives in the unit's file; read into a fresh window (NvmeState.read_compute)
            shared.copy_(spill.read_compute(unit, "node copy"))
        self.node_copy.publish(self._index[unit], self.versions[unit])
        if self.local_groups:
            group = self.local_groups[self.world.local_rank(self.rank)]
            dist.broadcast(shared, src=self.rank, group=group)

    def from_this_node(self, unit: int) -> bool:
        """The unit's owner is on this node: its new compute copy appears in the node copy without a collective, and
        a rank waits for it only where it reads it (`expect_local` / `await_local`)."""
        return self.world.node_of(self.owners[unit]) == self.world.node_of(self.rank)

    def expect_local(self, unit: int) -> None:
        """This step's update of ``unit`` (owned by another rank of this node) is issued: its next version is
        awaited (`local_updated`, `await_local`)."""
        self.versions[unit] += 1

    def local_updated(self, unit: int) -> bool:
        """Whether the owner has published this step's version of ``unit`` (never blocks)."""
        return self.node_copy.version(self._index[unit]) >= self.versions[unit]

    def await_local(self, handle, unit: int) -> None:
        """Wait for this step's version of ``unit`` from its owner on this node, then refresh a plan-resident
        unit's slot (Note: [The node's compute copy is shared by its ranks])."""
        self.node_copy.wait(self._index[unit], self.versions[unit], self.owners[unit])
        handle.sync_compute(unit, compute_written=True)  # a plan-resident unit's slot re-uploaded
        self.received[unit] = self.received.get(unit, 0) + 1

    def receive_compute(self, handle, unit: int, step: int) -> None:
        """Note: [The node's compute copy is shared by its ranks]
        The compute copy of every unit lives once per node, in a `NodeCopy` every local rank maps (the host store
        carves each unit's compute bytes from it); fp32 masters, moments and accumulators live on the unit's owner
        only. The owner writes the unit's new compute copy into the node copy (with an fp32 compute copy its master
        is that memory, Note: [Compute copy aliases the fp32 master] in streaming/store.py) and publishes the unit's
        next version (`send_compute`). Another rank of the node does not wait for it in its own update loop (that
        would make the ranks update one unit at a time, taking turns): it marks the version as expected
        (`expect_local`) and waits for it where it reads the unit, at the unit's next fetch (`await_local` from the
        updater's fetch guard; a prefetch only checks `local_updated`), so Note: [Update before fetch] in
        training/updater.py holds across ranks while every rank updates its own units at once. A unit owned on
        another node arrives here, in the updater's unit order (a collective: every rank of the group calls it in
        the same order), by a broadcast from its owner to the rank with the owner's local rank on each other node
        (one gloo group per local rank), which writes it into its node's copy and publishes it; those bytes are
        recorded in the trace on the lane ``net`` as ``gather`` (the unit's compute-copy bytes, once per step).

        The owner never rewrites a unit while another rank may still fetch its previous version: it updates a unit
        after the global norm (Note: [The global norm of a partitioned state]), which every rank enters only after
        its whole backward, and a unit's last fetch of a step is consumed by its backward before the unit is
        complete and its gradient reduced (a collective the owner also needs first). A unit fetched twice in a step
        (the backward re-fetch, the tied embedding that the head binds again: Note: [Streamed embeddings and
        head] in streaming/units.py) completes after both uses. The rank receiving from another node writes the
        node copy at the same point of the step, after its own fetches (`TransferEngine.wait_host_reads`). Tests:
        ``tests/test_trainer_ddp.py``."""
        import torch.distributed as dist

        if self.from_this_node(unit):
            self.expect_local(unit)
            self.await_local(handle, unit)
            return
        self.versions[unit] += 1
        owner = self.owners[unit]
        w = self.world
        if w.local_rank(owner) == w.local_rank(self.rank):
            shared = handle.store.shared_compute[unit]
            handle.engine.wait_host_reads(unit)  # Note: [Host compute copy is not rewritten while a fetch reads it]
            dist.broadcast(shared, src=owner, group=self.local_groups[w.local_rank(owner)])
            handle.trace.transfer("net", shared.numel(), "uint8", unit, "gather", step=step)
            self.node_copy.publish(self._index[unit], self.versions[unit])
        else:
            self.node_copy.wait(self._index[unit], self.versions[unit], owner)
        handle.sync_compute(unit, compute_written=True)  # a plan-resident unit's slot re-uploaded
        self.received[unit] = self.received.get(unit, 0) + 1

    # ------------------------------------------------------------------ end of training
    def gather_masters(self, handle, updater) -> None:
        """Give every rank the fp32 masters of every unit whose compute copy is in another dtype (a bf16 compute copy
        of an fp32 model), so `StreamHandle.remove()` gives every parameter its fp32 value as on one process (Note:
        [A bf16 compute copy of an fp32 model] in streaming/hooks.py). Called on every rank, in unit order, after the
        last update; nothing to do when every compute copy is the masters' dtype.

        Note: [Masters live in the node's segment]
            Each rank gets the whole fp32 model back, but not in its own memory: N copies of the fp32 model per node
            at the end of `train()` (in a run with a bf16 compute copy, the recipe's) is what partitioning the state
            avoids. The masters live in one more node segment (a `NodeCopy` of their bytes, one buffer and version
            per unit, `node_masters`), created with the node copy: a unit's owner keeps its masters there while it
            trains (the host store takes the unit's buffer, `HostStore.node_masters`), so giving them back copies
            nothing and the node never holds them twice (in the owner's memory and in the segment; a unit whose
            state is on NVMe keeps its masters in its file). At the end each owner publishes its units (a unit on
            NVMe read from its file first); a rank of another node with the owner's local rank receives them by a
            broadcast in the local-rank group and writes them into its node's segment, and publishes them. Every
            rank waits for every unit, then views it through its copy-on-write mapping (`NodeCopy.private_view`;
            the layer's ``masters_shared``), which `remove()` gives the parameters as it is (Note: [Parameters
            given back share the node copy] in streaming/binder.py); the optimizer, which outlives `train()`, keeps
            the owner's shared buffer. A unit whose state is on NVMe on this rank is left on disk (Note: [Units on
            NVMe after remove()] in streaming/nvmestate.py). The segment is closed with the node copy (`close`);
            the mappings handed out outlive it. Test: tests/test_trainer_ddp.py (the bf16 compute copy)."""
        import torch.distributed as dist

        updater.wait_all()
        units = [(unit, handle.store.layers[unit]) for unit in self._cast_units(handle)]
        if not units:
            return
        if self.masters_copy is None:  # built without `masters_elems` (the segment is made now)
            self._make_masters_segment({unit: ls.layout.train_elems for unit, ls in units})
        # the segment's units are the store's cast units, in order (made from them, or checked by `bind`)
        seg, w, spill = self.masters_copy, self.world, handle.nvme_state
        views = [self.node_masters[unit] for unit, _ in units]
        for j, ((unit, ls), dst) in enumerate(zip(units, views)):
            owner = self.owners[unit]
            if owner == self.rank and spill is not None and unit in spill.units:
                for e in ls.trainable_entries:  # the masters live in the unit's file
                    dst.narrow(0, e.elem_offset, e.numel).copy_(spill.read_param(unit, e.name, "master").reshape(-1))
            elif owner == self.rank and ls.master.data_ptr() != dst.data_ptr():
                dst.copy_(ls.master)
            if w.local_rank(owner) != w.local_rank(self.rank):
                continue  # another local rank of this node writes it
            if w.nodes > 1:
                dist.broadcast(dst, src=owner, group=self.local_groups[w.local_rank(owner)])
            seg.publish(j, 1)
        for j, ((unit, ls), dst) in enumerate(zip(units, views)):
            seg.wait(j, 1, self.owners[unit])
            if spill is not None and unit in spill.units:
                continue  # left on disk by remove()
            ls.master = seg.private_view(dst)
            ls.master_views = {
                e.name: ls.master.narrow(0, e.elem_offset, e.numel).view(e.shape) for e in ls.trainable_entries
            }
            ls.masters_shared = True
