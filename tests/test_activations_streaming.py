"""The activation engine driven by the streaming executor (`lazytrain_hf.streaming.attach`): the executor builds the
engine from the plan, packs weights as slot references, issues reloads per ``plan.issue_schedule()`` and ends the
step after backward. Gradients must stay bit-identical to plain autograd under every policy (dropout included).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from lazytrain_hf import streaming
from lazytrain_hf.activations import ActivationEngine
from lazytrain_hf.models import layer_kinds
from lazytrain_hf.planner.plan import Plan

VECTORS = {
    "nvme": ["offload_nvme"] * 4,
    "recompute_offloaded_input": [("recompute", "cpu"), ("recompute", "nvme")] * 2,
    "mixed": ["keep", "offload_cpu", ("recompute", "nvme"), "offload_nvme"],
}


def batch(seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def plan_for(model, vector) -> Plan:
    plan = Plan.default(4, layer_kinds(model.config))
    for lp, p in zip(plan.layers, vector):
        lp.policy, lp.input_tier = p if isinstance(p, tuple) else (p, "gpu")
    return plan.validate()


@pytest.mark.parametrize(
    "model_type,name",
    [("qwen3", n) for n in ("nvme", "recompute_offloaded_input", "mixed")] + [("qwen3_moe", "mixed")],
)
def test_executor_runs_every_policy_bit_exact(tmp_path, model_type, name):
    dropout = 0.3 if model_type == "qwen3" else 0.0  # recompute must replay the dropout masks
    ref = tiny_model(model_type, attention_dropout=dropout).train()
    torch.manual_seed(5)
    ref_loss = ref(**batch()).loss
    ref_loss.backward()
    ref_g = {n: p.grad for n, p in ref.named_parameters()}

    model = tiny_model(model_type, attention_dropout=dropout).train()
    plan = plan_for(model, VECTORS[name])
    handle = streaming.attach(model, plan, "cpu", nvme_dir=str(tmp_path))
    try:
        engine = handle.activations
        assert isinstance(engine, ActivationEngine) and engine.param_packer == handle  # a weak proxy of it
        for _ in range(2):  # two steps: pool reuse, per-step files
            torch.manual_seed(5)
            loss = model(**batch()).loss
            loss.backward()
        assert torch.equal(loss.detach(), ref_loss.detach())
        grads = handle.grads()
        bad = [n for n in ref_g if not torch.equal(2 * ref_g[n], grads[n].to(ref_g[n].dtype))]
        assert not bad, f"{len(bad)} gradients differ, first {bad[:3]}"
        stats = handle.memory_stats()
        assert stats["activation_gpu_bytes"] == stats["activation_cpu_bytes"] == stats["activation_nvme_bytes"] == 0
        assert engine.spill_files() == []
        assert engine.memory_stats()["cpu_peak_bytes"] > 0
    finally:
        handle.remove()
