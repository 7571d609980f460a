"""The data-parallel world a plan runs in, and which rank owns each streamed unit's training state.

With ``world_size`` ranks on ``nodes`` nodes (the same number of ranks on each, as `torch.distributed.run` launches
them), the training state of the streamed units is partitioned by unit: each unit's fp32 master, 8-bit moments and
gradient accumulator live on exactly one rank, its owner (`unit_owners`); the compute copy that fetches read lives
once per node. The planner sizes host memory and the reduce / gather traffic with these functions and the executor
partitions its state with the same ones, so a prediction is the executor's layout by construction.

Note: [The training state is partitioned by unit]
    A unit (a decoder layer, the embedding or the head unit) is updated by one rank in one fused pass over its flat
    buffers: the optimizer's decay groups, the 8-bit blocks and a unit's state file are per unit, so partitioning by
    unit needs no split parameter, block or file. Units go to ranks in layer order, each to the rank with the fewest
    trainable elements so far (ties: the lowest rank), so equal decoder layers are dealt round-robin: every rank
    updates a layer of the front of the model early, and the next forward can start while the back is updated.
    Units with nothing to train have no owner (``-1``).
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
    each unit with trainable elements goes to the rank with the fewest so far (ties: the lowest rank); a unit with
    none gets ``-1``."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1.")
    load = [0] * world_size
    out = []
    for n in trainable_elems:
        if n <= 0:
            out.append(-1)
            continue
        r = min(range(world_size), key=lambda k: (load[k], k))
        load[r] += int(n)
        out.append(r)
    return out
