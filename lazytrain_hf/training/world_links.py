"""The bandwidths of a data-parallel world's links, measured by its ranks at ``train()`` start.

Note: [The world's links are measured]
    The planner prices a data-parallel step with three link bandwidths of the hardware profile
    (`lazytrain_hf.planner.worldcost`): ``shm_gbps``, a gradient reduce among the ranks of one node on the host
    (gloo); ``device_net_gbps``, the same reduce on the devices (``Plan.dp_reduce == "device"``: NCCL on CUDA, gloo
    on the CPU device); ``net_gbps``, the link between nodes. A bundled profile can only assume them (two PCIe GPUs
    without peer-to-peer, a 100 Gb/s link); with ``planner_hardware="auto"`` the profile is this machine's, so the
    links are this world's: every rank enters `measure_links` before rank 0 plans (Note: [One plan for every rank]
    in trainer.py), which times, on groups of its own, the collective each figure prices:

    - ``shm_gbps``: a host reduce of ``nbytes`` (fp32) to the first rank of each node, among that node's ranks;
    - ``device_net_gbps``: the same reduce of a tensor on each rank's device, on the device backend;
    - ``net_gbps`` (several nodes): a reduce among one rank per node, whose root receives ``nodes - 1`` messages
      over its node's link (`NetTimes.reduce_arrival` charges ``world_size - local_world_size`` messages at it).

    Each figure is ``nbytes`` (rounded down to whole fp32 elements; times the remote messages for ``net_gbps``) over the median of ``repeats`` timed
    collectives after one untimed, each from a barrier of the group to a barrier after it (the root's reduce is
    complete), CUDA synchronised on the device. The slowest rank's median is taken (a MAX all-reduce), so every rank
    holds the same figures; a figure with no peers to measure (one rank per node: no ``shm_gbps`` /
    ``device_net_gbps``; one node: no ``net_gbps``) is left to the profile. Rank 0 replaces the profile's figures
    with these (`planning.with_world_links`, named in its ``source``). Tests: ``tests/test_world_links.py``.
"""

from __future__ import annotations

import datetime
import math
import statistics
import time

import torch

from ..planner.world import World

LINK_PROBE_BYTES = 16 << 20
LINK_KEYS = ("shm_gbps", "device_net_gbps", "net_gbps")


def _timed_reduce(t: torch.Tensor, root: int, group, repeats: int, cuda: bool) -> float:
    import torch.distributed as dist

    times = []
    for k in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(t.device)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.reduce(t, dst=root, op=dist.ReduceOp.SUM, group=group)
        if cuda:
            torch.cuda.synchronize(t.device)
        dist.barrier(group=group)
        if k:  # the first one sets the connections up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _groups(ranks_per_group: list[list[int]], backend: str, timeout: datetime.timedelta, rank: int, made: list):
    """One group per rank list (every rank creates every group, in the same order); this rank's (also appended to
    ``made``), or None."""
    import torch.distributed as dist

    mine = None
    for ranks in ranks_per_group:
        g = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            mine = g
            made.append(g)
    return mine


def measure_links(
    world: World,
    device: torch.device | str,
    nbytes: int = LINK_PROBE_BYTES,
    repeats: int = 3,
    timeout_s: float = 300.0,
) -> dict[str, float]:
    """Note: [The world's links are measured]. Every rank of ``world`` calls it (collectives, in the same order),
    after ``torch.distributed`` is initialised. Returns ``{figure: GB/s}`` (`LINK_KEYS` that this world can
    measure), the same on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("measure_links needs an initialised torch.distributed process group (one per rank).")
    if dist.get_world_size() != world.world_size:
        raise ValueError(
            f"measure_links: the world has {world.world_size} ranks, the process group {dist.get_world_size()}."
        )
    if nbytes < 4 or repeats < 1:
        raise ValueError(f"measure_links(nbytes={nbytes}, repeats={repeats}): need nbytes >= 4 and repeats >= 1.")
    rank = dist.get_rank()
    timeout = datetime.timedelta(seconds=float(timeout_s))
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    lw, nodes = world.local_world_size, world.nodes
    n = nbytes // 4
    seconds: dict[str, float] = {}
    made: list = []
    try:
        if lw > 1:
            per_node = [list(range(k * lw, (k + 1) * lw)) for k in range(nodes)]
            root = world.node_of(rank) * lw
            host = _groups(per_node, "gloo", timeout, rank, made)
            seconds["shm_gbps"] = _timed_reduce(torch.ones(n), root, host, repeats, False)
            on_dev = _groups(per_node, "nccl" if cuda else "gloo", timeout, rank, made)
            seconds["device_net_gbps"] = _timed_reduce(torch.ones(n, device=dev), root, on_dev, repeats, cuda)
        if nodes > 1:
            leaders = [k * lw for k in range(nodes)]
            group = _groups([leaders], "gloo", timeout, rank, made)
            if group is not None:
                seconds["net_gbps"] = _timed_reduce(torch.ones(n), 0, group, repeats, False)
        # the slowest rank's figures, on every rank (a rank outside the leaders' group adds 0 s for net_gbps)
        agree = dist.new_group(backend="gloo", timeout=timeout)
        made.append(agree)
        vec = torch.tensor([seconds.get(k, 0.0) for k in LINK_KEYS], dtype=torch.float64)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=agree)
    finally:
        for g in made:
            dist.destroy_process_group(g)
    wanted = {"shm_gbps": lw > 1, "device_net_gbps": lw > 1, "net_gbps": nodes > 1}
    out = {}
    for key, s in zip(LINK_KEYS, vec.tolist()):
        if not wanted[key]:
            continue
        if not (math.isfinite(s) and s > 0):
            raise RuntimeError(f"measure_links: the {key} probe took {s} s; expected a positive time.")
        messages = nodes - 1 if key == "net_gbps" else 1
        out[key] = messages * 4 * n / s / 1e9
    return out
