"""Where a data-parallel world reduces each unit's gradient to its owner: the plan's ``dp_reduce`` decision.

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
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .plan import DP_REDUCE, Plan
from .simulate import simulate
from .world import World


def predicted_steps(plan: Plan, cost_model: Any) -> dict[str, float]:
    """``{dp_reduce: simulated step seconds}`` of ``plan`` in its world with each way of reducing (the slowest rank's
    step, `simulate.simulate`); ``plan`` is not changed."""
    return {mode: simulate(dataclasses.replace(plan, dp_reduce=mode), cost_model).step_time_s for mode in DP_REDUCE}


def decide(plan: Plan, cost_model: Any, world: World | None = None) -> Plan:
    """Set ``plan``'s world (``world``; default: the plan's) and its ``dp_reduce`` to the way with the shorter
    predicted step (`predicted_steps`; ties: ``"host"``), recorded in ``plan.predicted["dp_reduce_step_s"]``. A plan
    for one rank keeps ``"host"`` (nothing to reduce). Returns ``plan``."""
    if world is not None:
        plan.world_size, plan.nodes = world.world_size, world.nodes
    if plan.world_size <= 1:
        plan.dp_reduce = "host"
        return plan
    steps = predicted_steps(plan, cost_model)
    plan.dp_reduce = min(DP_REDUCE, key=lambda mode: (steps[mode], mode != "host"))
    plan.predicted["dp_reduce_step_s"] = steps
    return plan
