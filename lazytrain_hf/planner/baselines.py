"""Fixed policies to compare the MILP against, expressed as plans (so the simulator replays them the same way).

- ``megatrain``: MegaTrain's executor: the input of every K=4-th layer is checkpointed on the device, each block is
  recomputed as a whole in backward (its weights cross PCIe a third time for that), prefetch depth 1, nothing
  resident, and the CPU optimizer runs after backward with the device idle (no overlap with the next forward).
- ``all_recompute``: every layer recomputed from its input kept on the device, prefetch depth 1.
- ``keep_all``: every layer keeps what it saves on the device, prefetch depth 1.
- ``cpu_offload_inputs``: Unsloth-style: every layer's input goes to pinned host memory and the layer is
  recomputed in backward (input reloaded one stage ahead), prefetch depth 1.

The last three overlap the CPU optimizer with the next forward like LazyTrain's executor, so they isolate the
activation policy; ``megatrain`` is the matched layer-streaming baseline of the paper.
"""

from __future__ import annotations

from .costmodel import CostModel
from .milp import _fits, evaluate_plan
from .plan import LayerPlan, Plan

BASELINES: tuple[str, ...] = ("megatrain", "all_recompute", "keep_all", "cpu_offload_inputs")
MEGATRAIN_CHECKPOINT_EVERY = 4


def make_baseline(name: str, cost_model: CostModel, *, checkpoint_every: int = MEGATRAIN_CHECKPOINT_EVERY) -> Plan:
    """The baseline plan ``name`` (one of `BASELINES`) for ``cost_model``, with ``predicted`` filled in from the
    stage model."""
    if name not in BASELINES:
        raise ValueError(f"baseline={name!r} is not known; use one of {', '.join(BASELINES)}.")
    cm = cost_model
    policy, tier = {
        "megatrain": ("recompute", "gpu"),
        "all_recompute": ("recompute", "gpu"),
        "keep_all": ("keep", "gpu"),
        "cpu_offload_inputs": ("recompute", "cpu"),
    }[name]
    layers = [
        LayerPlan(
            index=i,
            kind=lc.kind,
            policy=policy,
            input_tier=tier,
            fetch_fwd_ahead=1,
            fetch_bwd_ahead=1,
            reload_ahead=1,
        )
        for i, lc in enumerate(cm.layers)
    ]
    plan = Plan(
        layers=layers,
        micro_batch_size=cm.micro_batch_size,
        seq_len=cm.seq_len,
        loss_chunk_tokens=cm.loss_chunk_tokens,
        source=f"baseline:{name}",
        hardware=cm.hardware.name,
        model=cm.model_name,
        checkpoint_every=checkpoint_every if name == "megatrain" else 1,
        optimizer_overlap=name != "megatrain",
    )
    plan.predicted = evaluate_plan(plan, cm).predictions()
    return plan


def fits(plan: Plan, cost_model: CostModel, gpu_budget: int, host_budget: int, nvme_budget: int = 0) -> bool:
    """Whether ``plan`` fits the budgets under the stage model's memory accounting (the MILP's own test)."""
    return _fits(evaluate_plan(plan, cost_model), gpu_budget, host_budget, nvme_budget)


def max_batch_size(name: str, cost_model: CostModel, gpu_budget: int, host_budget: int, max_batch: int = 256) -> int:
    """Largest micro-batch size at which baseline ``name`` fits (0: not even 1)."""
    from .milp import max_feasible_batch

    def ok(b: int) -> bool:
        cm = cost_model.with_batch(b)
        return fits(make_baseline(name, cm), cm, gpu_budget, host_budget)

    return max_feasible_batch(ok, max_batch)
