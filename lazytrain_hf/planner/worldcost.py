"""Times of a data-parallel world (`lazytrain_hf.planner.world`): what the simulator and the MILP add for it.

Each rank updates only the units it owns (Note: [The training state is partitioned by unit]), so its CPU optimizer
step is the time of its owned units at its share of the node's optimizer rate (`world.optimizer_rate_per_rank`),
and a unit is ready for the next forward when its owner has updated it, plus the ``gather`` of its compute copy on
the nodes the owner is not on. Gradients cross the ``net`` lane (`lazytrain_hf.planner.schedule`): a ``reduce`` to
an owner on the same node goes through shared memory (``BW_shm``, per rank), to another node over the node's link
(``BW_net``), which its ranks share (they send at the same time in a symmetric step). With ``Plan.dp_reduce ==
"device"`` a ``reduce_device`` sums the unit's gradient into the owner's on the devices (``BW_dev_net``,
`NetTimes.device_reduce_s`) before the owner's D2H copy.

- `NetTimes`: the ``net`` lane's bandwidth per transfer, when a unit's gradients from every rank have reached its
  owner, and when each owner finishes each unit (all ranks start their optimizer step together), for
  `lazytrain_hf.planner.simulate`;
- `WorldCostModel` / `for_world`: a `CostModel` whose optimizer times are the world's (a unit's update is done when
  its owner's updates up to it are, plus its gather; the resident parameters, which every rank updates, at the
  rank's rate), so the stage model and the MILP plan with the step a rank of the world sees.

Ranks are symmetric: a peer's reduces of a stage queue behind its earlier ones as this rank's do, and every rank's
backward ends at the same time. The reduce and gather traffic is not in the stage model's lanes (only in the
simulator): the MILP sees the world through the optimizer times and the host budget per node
(`hostmem.world_footprint`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .costmodel import CostModel
from .world import World, gather_receiver, optimizer_rate_per_rank, owners_by_key, unit_order


class NetTimes:
    """The world's times for one rank's replay (module docstring).

    Args:
        cm: the cost model (its hardware's ``net_gbps`` / ``shm_gbps`` and optimizer rate, the units' sizes).
        world: the world; ``rank`` the rank replayed.
        owners: ``{unit key: owner}`` (`schedule.unit_owners_of`); ``train_elems`` and ``weight``: per unit key,
            its gradient accumulator's elements and its compute copy's bytes.
        stream_embeddings: the embedding and head are units (keys ``-1`` and ``L``).
    """

    def __init__(
        self,
        cm: CostModel,
        world: World,
        rank: int,
        owners: dict[int, int],
        train_elems: dict[int, int],
        weight: dict[int, int],
        stream_embeddings: bool,
    ):
        self.cm, self.world, self.rank, self.owners = cm, world, rank, owners
        self.train_elems, self.weight = train_elems, weight
        self.order = unit_order(cm.num_layers, stream_embeddings)
        hw = cm.hardware
        self.rate = optimizer_rate_per_rank(hw.cpu_optimizer_params_per_s, world)
        self.shm = hw.shm_bytes_per_s
        self.net = hw.net_bytes_per_s / world.local_world_size  # the node's link, shared by its ranks

    def bandwidth(self, peer: int | None) -> float:
        """Bytes/s of a ``net`` transfer between this rank and ``peer``."""
        same = peer is not None and self.world.node_of(peer) == self.world.node_of(self.rank)
        return self.shm if same else self.net

    def reduce_arrival(self, key: int, ready: float) -> float:
        """When every other rank's gradient of unit ``key`` has reached its owner, given ``ready``: the time this
        rank's gradient of it was on the host and its earlier reduces were sent (the peers are in the same state).
        Ranks of the owner's node copy theirs in parallel through shared memory; those of the other nodes share the
        owner node's link."""
        n = 4 * self.train_elems.get(key, 0)
        w = self.world
        local = n / self.shm if w.local_world_size > 1 else 0.0
        remote = (w.world_size - w.local_world_size) * n / self.cm.hardware.net_bytes_per_s
        return ready + max(local, remote)

    def device_reduce_s(self, nbytes: int) -> float:
        """Seconds of a unit's reduce to its owner on the devices (``Plan.dp_reduce == "device"``; Note: [Gradients
        reduced on the device skip the other ranks' D2H] in streaming/gradients.py): ``nbytes`` (the gradient in its
        dtype) over the node's device interconnect (``BW_dev_net``, NCCL's bus bandwidth: a reduce moves about its
        message size per rank whatever the number of ranks), plus once over the nodes' link when the world spans
        several (the partial sums of the other nodes; an assumed bound, NCCL over InfiniBand is faster than gloo)."""
        hw = self.cm.hardware
        t = nbytes / hw.device_net_bytes_per_s
        return t + (nbytes / hw.net_bytes_per_s if self.world.nodes > 1 else 0.0)

    def unit_optimizer_s(self, key: int) -> float:
        """The owner's optimizer seconds for unit ``key`` at the rank's rate (its state I/O where that is longer)."""
        cm = self.cm
        L = cm.num_layers
        params = cm.embed_params if key == -1 else cm.head_params if key == L else cm.layers[key].params
        t = params / self.rate
        if 0 <= key < L and key in cm.state_nvme:
            _, r, w = cm.state_io_bytes(key)
            t = max(t, r / cm.nvme_r + w / cm.nvme_w)
        return t

    def finish_times(self, start: float) -> dict[int, float]:
        """``{unit key: when its owner has updated it}``, every owner starting its units at ``start`` in unit
        order."""
        acc: dict[int, float] = {}
        out: dict[int, float] = {}
        for k in self.order:
            o = self.owners.get(k, -1)
            if o < 0:
                continue
            acc[o] = acc.get(o, start) + self.unit_optimizer_s(k)
            out[k] = acc[o]
        return out

    def gather_s(self, key: int) -> float:
        """Seconds of the gather of unit ``key``'s compute copy to another node."""
        return self.weight.get(key, 0) / self.net


@dataclass
class WorldCostModel(CostModel):
    """A `CostModel` seen by a rank of ``world`` (module docstring): `optimizer_s_of` ``i`` is the increment of
    ``c_i = max_{j <= i} (owner(j)'s updates up to j + the gather of j)``, so `stages.optimizer_finish_times` gives
    when each layer is ready for the next forward on every rank; the resident embedding and head, which every rank
    updates, take ``local_world_size`` times longer (the node's rate is shared). Decoder layers only: the MILP plans
    the embedding and head resident."""

    world: World = field(default_factory=World)

    def _net(self, rank: int = 0) -> NetTimes:
        L = self.num_layers
        owners = owners_by_key({i: lc.params for i, lc in enumerate(self.layers)}, L, False, self.world.world_size)
        elems = {i: lc.params for i, lc in enumerate(self.layers)}
        weight = {i: lc.weight_bytes for i, lc in enumerate(self.layers)}
        return NetTimes(self, self.world, rank, owners, elems, weight, False)

    def reduce_drain_s(self) -> float:
        """Seconds from the end of backward until every unit's gradients are at its owner: what the slowest rank's
        reduces (sent one after the other on its ``net`` lane as each layer's backward completes) take beyond the
        backward's compute, plus the last unit's arrival at its owner. A constant of the world (the backward's
        stage times are taken at their compute), added before the optimizer step."""
        backward = sum(lc.bwd_s for lc in self.layers) + self.head_s
        send = 0.0
        for r in range(self.world.world_size):
            net = self._net(r)
            own = net.owners
            send = max(
                send, sum(4 * net.train_elems[k] / net.bandwidth(o) for k, o in own.items() if o not in (-1, r))
            )
        return max(0.0, send - backward) + self._net(0).reduce_arrival(0, 0.0) if self.layers else 0.0

    def _ready(self) -> list[float]:
        L = self.num_layers
        net = self._net(0)
        fin = net.finish_times(0.0)
        lane: dict[int, float] = {}  # per receiving rank: when its net lane is free (gathers run one at a time)
        out, c = [], 0.0
        for i in range(L):
            ready = fin.get(i, 0.0)
            for node in range(self.world.nodes):
                rcv = gather_receiver(self.world, net.owners.get(i, -1), node)
                if rcv >= 0:
                    lane[rcv] = max(fin[i], lane.get(rcv, 0.0)) + net.gather_s(i)
                    ready = max(ready, lane[rcv])
            nxt = max(c, ready)
            out.append(nxt - c)
            c = nxt
        return out

    def optimizer_s_of(self, i: int) -> float:
        if "_ready_cache" not in self.__dict__ or self.__dict__["_ready_cache"][0] != self.state_nvme:
            self.__dict__["_ready_cache"] = (self.state_nvme, self._ready())
        return self.__dict__["_ready_cache"][1][i]

    @property
    def embed_optimizer_s(self) -> float:
        """The resident embedding's update at the rank's rate, after the reduces have drained (`reduce_drain_s`):
        `stages.optimizer_finish_times` starts the optimizer step with it."""
        if "_drain" not in self.__dict__:
            self.__dict__["_drain"] = self.reduce_drain_s()
        rate = optimizer_rate_per_rank(self.hardware.cpu_optimizer_params_per_s, self.world)
        return self.__dict__["_drain"] + self.embed_params / rate

    @property
    def head_optimizer_s(self) -> float:
        return self.head_params / optimizer_rate_per_rank(self.hardware.cpu_optimizer_params_per_s, self.world)

    def with_batch(self, micro_batch_size: int) -> CostModel:
        return for_world(CostModel.with_batch(self, micro_batch_size), self.world)


def for_world(cm: CostModel, world: World | None) -> CostModel:
    """``cm`` as a rank of ``world`` sees it (`WorldCostModel`); ``cm`` itself for a single rank."""
    if world is None or world.world_size == 1:
        return cm
    base: dict[str, Any] = {f.name: getattr(cm, f.name) for f in dataclasses.fields(CostModel) if f.init}
    return WorldCostModel(**base, world=world)


def world_host_state_bytes(cm: CostModel, world: World) -> int:
    """`CostModel.host_state_bytes` of the largest node of ``world``: the shared compute copy once plus its ranks'
    state, staging and save transient (`hostmem.counts_world_footprint`), pinned activations left out."""
    from .hostmem import counts_world_footprint

    wf = counts_world_footprint(
        [lc.params for lc in cm.layers], cm.embed_params, cm.head_params, cm.dtype_bytes, world
    )
    return int(max(wf.node_peak(n) - sum(fp.activations for fp in wf.node_ranks(n)) for n in range(world.nodes)))


def record_world(plan: Any, cm: CostModel, world: World | None, gradient_accumulation_steps: int = 1) -> Any:
    """Set ``plan``'s world and, for several ranks, its ``predicted["bytes_per_step"]`` to rank 0's (with the
    ``net`` lane) for steps of ``gradient_accumulation_steps`` micro-batches; a single rank's plan is left as it is.
    Returns ``plan``."""
    if world is None or world.world_size == 1:
        return plan
    from .schedule import bytes_per_step, sizes_from_cost_model

    plan.world_size, plan.nodes = world.world_size, world.nodes
    sizes = sizes_from_cost_model(cm, plan.stream_embeddings)
    plan.predicted["bytes_per_step"] = bytes_per_step(plan, sizes, max(1, int(gradient_accumulation_steps)))
    return plan
