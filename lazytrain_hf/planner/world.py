"""The data-parallel world a plan runs in, and which rank owns each streamed unit's training state.

With ``world_size`` ranks on ``nodes`` nodes (the same number of ranks on each, as `torch.distributed.run` launches
them), the training state of the streamed units is partitioned by unit: each unit's fp32 master, 8-bit moments and
gradient accumulator live on exactly one rank, its owner (`unit_owners`); the compute copy that fetches read lives
once per node. The planner sizes host memory and the reduce / gather traffic with these functions and the executor
partitions its state with the same ones, so a prediction is the executor's layout by construction.

Note: [The training state is partitioned by unit]
    A unit (a decoder layer, the embedding or the head unit) is updated by one rank in one fused pass over its flat
    buffers: the optimizer's decay groups, the 8-bit blocks and a unit's state file are per unit, so partitioning by
    unit needs no split parameter, block or file. Units are dealt largest first (ties: in unit order), each to the
    rank with the fewest trainable elements so far (ties: the lowest rank), so the ranks' optimizer work differs by
    at most one unit's elements, and equal decoder layers are dealt round-robin in layer order: every rank updates a
    layer of the front of the model early, and the next forward can start while the back is updated. Dealt in unit
    order instead, a streamed embedding and head that are each ten layers' size left one rank the head and eleven
    of twelve layers (twice the other's elements). Units with nothing to train have no owner (``-1``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    """``world_size`` ranks on ``nodes`` nodes, ``world_size // nodes`` on each; rank ``r`` is on node
    ``r // local_world_size`` (the ranks of `torch.distributed.run`)."""

    world_size: int = 1
    nodes: int = 1

    def __post_init__(self) -> None:
        if int(self.world_size) < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1 (--world-size: the number of ranks in all).")
        if int(self.nodes) < 1:
            raise ValueError(f"nodes={self.nodes} must be >= 1 (--nodes: the number of machines).")
        if self.world_size % self.nodes:
            raise ValueError(
                f"world_size={self.world_size} is not a multiple of nodes={self.nodes}: every node runs the same "
                "number of ranks; pass --world-size as ranks per node x --nodes."
            )

    @property
    def local_world_size(self) -> int:
        return self.world_size // self.nodes

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def local_rank(self, rank: int) -> int:
        return rank % self.local_world_size


def unit_owners(trainable_elems: list[int], world_size: int) -> list[int]:
    """The owner rank of each unit, given in unit order (Note: [The training state is partitioned by unit]):
    largest first, each unit with trainable elements goes to the rank with the fewest so far (ties: the lowest
    rank); a unit with none gets ``-1``."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1.")
    load = [0] * world_size
    out = [-1] * len(trainable_elems)
    for i in sorted(range(len(trainable_elems)), key=lambda i: (-int(trainable_elems[i]), i)):
        if trainable_elems[i] <= 0:
            continue
        r = min(range(world_size), key=lambda k: (load[k], k))
        load[r] += int(trainable_elems[i])
        out[i] = r
    return out


def unit_order(num_layers: int, stream_embeddings: bool) -> list[int]:
    """The streamed units in the order their training state is dealt (`unit_owners`), by host-store key: the
    embedding unit (``-1``) when it is streamed, decoder layers ``0..L-1``, the head unit (``L``) when streamed."""
    return ([-1] if stream_embeddings else []) + list(range(num_layers)) + ([num_layers] if stream_embeddings else [])


def owners_by_key(
    train_elems: dict[int, int], num_layers: int, stream_embeddings: bool, world_size: int
) -> dict[int, int]:
    """``{unit key: owner rank}`` (``-1``: nothing to train) for the trainable elements of each streamed unit (the
    elements of its fp32 gradient accumulator, `lazytrain_hf.planner.layouts.LayerLayout.train_elems`), dealt in
    `unit_order` by `unit_owners`. A key missing from ``train_elems`` has no trainable element."""
    keys = unit_order(num_layers, stream_embeddings)
    return dict(zip(keys, unit_owners([int(train_elems.get(k, 0)) for k in keys], world_size)))


def gather_receiver(world: World, owner: int, node: int) -> int:
    """The rank of ``node`` that receives, after each optimizer step, the compute copy of a unit ``owner`` updated
    on another node (and writes it into the node's shared compute copy): the rank with the owner's local rank, so the
    gathers of a node are spread over its ranks as the units are. ``-1`` when ``owner`` is on ``node`` itself (the
    owner writes the node's copy in its fused pass) or owns nothing."""
    if owner < 0 or world.node_of(owner) == node:
        return -1
    return node * world.local_world_size + world.local_rank(owner)


def optimizer_rate_per_rank(params_per_s: float, world: World) -> float:
    """Parameters per second of one rank's CPU optimizer: the hardware profile's ``cpu_optimizer_params_per_s`` is
    the whole node's (all cores, bound by its memory bandwidth), shared by the node's ranks as they update their
    units at the same time. A step's optimizer work is divided by ``world_size`` (each rank updates its own units),
    its rate by the ranks per node: more nodes make the step shorter, more ranks on one node do not make it longer."""
    return params_per_s / world.local_world_size
