"""Where and how often a data-parallel world reduces each unit's gradient to its owner: the plan's ``dp_reduce`` and
``dp_reduce_every`` decision.

Two ways to get every rank's gradient of a streamed unit into its owner's fp32 accumulator (Note: [The training
state is partitioned by unit] in `lazytrain_hf.planner.world`), every micro-batch:

- ``"host"``: every rank copies the unit's gradient D2H (``BW_d2h``), and gloo sums the fp32 host copies into the
  owner's accumulator over shared memory or the nodes' link (``BW_shm`` / ``BW_net``, on the ``net`` lane, beside
  the compute);
- ``"device"``: the ranks sum the gradient into the owner's device gradient first (NCCL; ``BW_dev_net``), in the
  gradient's dtype, and only the owner copies it D2H: each rank moves its own units' gradients across PCIe, not every
  unit's. The reduce is ordered on the compute stream, so the next backward waits for it.

The device path pays where PCIe (and the host reduce) is the bottleneck and the device interconnect is fast (NVLink);
the host path where the devices talk over PCIe through host memory and the backward hides the host's reduces.
`decide` replays the plan both ways (`simulate.simulate`, the slowest rank) and keeps the shorter step (the host
path on a tie: today's behaviour); ``plan.predicted["dp_reduce_step_s"]`` records both steps. The MILP itself plans
with the host path's reduce times (`worldcost.WorldCostModel.reduce_drain_s`): the choice is made on its plan, after
the solve (`milp.plan_for_model` with a world; `LazyTrainer` on rank 0, `training.planning.set_dp_reduce`).

With gradient accumulation (``g`` micro-batches per optimizer step) the host path can also reduce once per step
(``dp_reduce_every == "step"``, Note: [Gradients reduced once per step] in streaming/gradients.py): each rank adds
its gradient of a unit it does not own into its own fp32 accumulator and sends it once, after the last micro-batch,
so the ``net`` lane carries ``1/g`` of the bytes; it costs a rank an fp32 accumulator of every unit it does not own
(`hostmem.HostFootprint.step_grads`). `decide` replays the g micro-batches of a step (``simulate(...,
micro_batches=g)``) for every eligible pair of {host, device} x {micro_batch, step}: ``("device", "step")`` never
(the device path would have to keep the gradients on the device across micro-batches), ``("host", "step")`` only with
``g > 1`` and when the node's host footprint with the accumulators fits the host memory. Ties keep the earlier pair
of `CANDIDATES` (the per-micro-batch host path first: without gradient accumulation both cadences are the same and
the plan says ``"micro_batch"``). ``plan.predicted["dp_reduce_step_s"]`` records the step of every pair simulated
(keys ``"host"``, ``"device"``, ``"host/step"``) and ``"dp_reduce_step_host_bytes"`` the node's host bytes with
the accumulators.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .plan import DP_REDUCE, Plan
from .simulate import simulate
from .world import World

# (dp_reduce, dp_reduce_every) pairs in the order ties are broken
CANDIDATES: tuple[tuple[str, str], ...] = (("host", "micro_batch"), ("device", "micro_batch"), ("host", "step"))


def key_of(mode: str, every: str) -> str:
    """The key of a pair in ``plan.predicted["dp_reduce_step_s"]``: ``"host"``, ``"device"``, ``"host/step"``."""
    return mode if every == "micro_batch" else f"{mode}/{every}"


def step_host_bytes(plan: Plan, cost_model: Any) -> int:
    """The largest node's host bytes with ``dp_reduce_every == "step"`` (`hostmem.counts_world_footprint` with the
    accumulators of the units each rank does not own, plus the plan's pinned activations on every rank)."""
    from .hostmem import counts_world_footprint

    cm, world = cost_model, plan.world
    wf = counts_world_footprint(
        [lc.params for lc in cm.layers], cm.embed_params, cm.head_params, cm.dtype_bytes, world, "step"
    )
    acts = int(plan.predicted.get("pinned_host_bytes", 0) or 0)
    for fp in wf.ranks:
        fp.activations = acts
    return int(max(wf.node_peak(n) for n in range(world.nodes)))


def predicted_steps(
    plan: Plan, cost_model: Any, gradient_accumulation_steps: int = 1, pairs: tuple[tuple[str, str], ...] = ()
) -> dict[str, float]:
    """``{key_of(pair): simulated seconds of an optimizer step}`` of ``plan`` in its world for each pair (default: the
    per-micro-batch host and device paths), ``gradient_accumulation_steps`` micro-batches a step (the slowest rank's
    step, `simulate.simulate`); ``plan`` is not changed."""
    pairs = pairs or tuple((mode, "micro_batch") for mode in DP_REDUCE)
    g = max(1, int(gradient_accumulation_steps))
    return {
        key_of(mode, every): simulate(
            dataclasses.replace(plan, dp_reduce=mode, dp_reduce_every=every), cost_model, micro_batches=g
        ).step_time_s
        for mode, every in pairs
    }


def decide(
    plan: Plan,
    cost_model: Any,
    world: World | None = None,
    gradient_accumulation_steps: int = 1,
    host_memory_bytes: int | None = None,
    every: str = "auto",
    mode: str = "auto",
) -> Plan:
    """Set ``plan``'s world (``world``; default: the plan's), its ``dp_reduce`` and ``dp_reduce_every`` to the eligible
    pair (module docstring) with the shortest predicted step of ``gradient_accumulation_steps`` micro-batches
    (`predicted_steps`), recorded in ``plan.predicted["dp_reduce_step_s"]``. ``host_memory_bytes``: what a node's host
    footprint with the step accumulators must fit (default: the hardware's host memory); ``every``: ``"auto"``, or
    ``"micro_batch"`` / ``"step"`` to choose only among the pairs with that cadence (``planner_dp_reduce_every``);
    ``mode``: likewise ``"host"`` / ``"device"`` (``planner_dp_reduce``).
    A plan for one rank keeps ``"host"`` / ``"micro_batch"`` (nothing to reduce). Returns ``plan``."""
    if world is not None:
        plan.world_size, plan.nodes = world.world_size, world.nodes
    if plan.world_size <= 1:
        plan.dp_reduce, plan.dp_reduce_every = "host", "micro_batch"
        return plan
    g = max(1, int(gradient_accumulation_steps))
    pairs = [(m, e) for m, e in CANDIDATES if every in ("auto", e) and mode in ("auto", m)]
    if not pairs:
        raise ValueError(
            f"dp_reduce={mode!r} with dp_reduce_every={every!r}: no such way to reduce (gradients reduced once per "
            "step are accumulated on the host); pass 'host' with 'step', or 'micro_batch' with 'device'."
        )
    if ("host", "step") in pairs and every == "auto":
        limit = cost_model.hardware.host_memory_bytes if host_memory_bytes is None else int(host_memory_bytes)
        need = plan.predicted["dp_reduce_step_host_bytes"] = step_host_bytes(plan, cost_model)
        if g == 1 or need > limit:
            pairs.remove(("host", "step"))
    steps = predicted_steps(plan, cost_model, g, tuple(pairs))
    best = min(pairs, key=lambda p: (steps[key_of(*p)], CANDIDATES.index(p)))
    plan.dp_reduce, plan.dp_reduce_every = best
    plan.predicted["dp_reduce_step_s"] = steps
    return plan
