"""Property: gradients are bit-identical to plain autograd under ANY per-layer (policy, input_tier) vector.

Hypothesis draws the vector (and whether reloads are prefetched) for tiny qwen3 and qwen3_moe (4 layers, hidden 32);
the engine only moves data, so `torch.equal` on every gradient. The CUDA variant (marked ``gpu``) runs the same on
the device with deterministic kernels, which exercises the side streams, events and pinned buffers.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from conftest import tiny_model
from helpers.standalone import attach_standalone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lazytrain_hf.activations import ActivationEngine
from lazytrain_hf.models import layer_kinds
from lazytrain_hf.planner.plan import INPUT_TIERS, POLICIES, Plan

# cuBLAS needs this before its first use to be deterministic (read at handle creation)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

LAYER = st.one_of(
    st.sampled_from([p for p in POLICIES if p != "recompute"]).map(lambda p: (p, "gpu")),
    st.sampled_from(INPUT_TIERS).map(lambda t: ("recompute", t)),
)
VECTOR = st.lists(LAYER, min_size=4, max_size=4)
_SPILL = tempfile.mkdtemp(prefix="lazytrain-act-test-")


def plan_for(model: torch.nn.Module, vector: list[tuple[str, str]]) -> Plan:
    plan = Plan.default(4, layer_kinds(model.config))
    for lp, (policy, tier) in zip(plan.layers, vector):
        lp.policy, lp.input_tier = policy, tier
    return plan.validate()


def grads(model, ids, engine=None, prefetch=True, seed=3):
    model.zero_grad(set_to_none=True)
    handle = attach_standalone(model, engine, prefetch=prefetch) if engine is not None else None
    try:
        torch.manual_seed(seed)
        if ids.is_cuda:
            torch.cuda.manual_seed(seed)
        model(ids, labels=ids).loss.backward()
        if engine is not None:
            engine.end_step()
    finally:
        if handle is not None:
            handle.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def check(model, ids, ref, vector, prefetch, device) -> set[str]:
    """One step under ``vector``; asserts bit-exact gradients and empty tiers; returns the names compared."""
    engine = ActivationEngine(plan_for(model, vector), device, nvme_dir=_SPILL)
    try:
        got = grads(model, ids, engine, prefetch)
        assert engine.spill_files() == []
        st_ = engine.memory_stats()
        assert st_["gpu_bytes"] == st_["cpu_bytes"] == st_["nvme_bytes"] == 0
    finally:
        engine.close()
    bad = [n for n in ref if not torch.equal(ref[n], got[n])]
    assert not bad, f"{vector} prefetch={prefetch}: {len(bad)} gradients differ, first {bad[:3]}"
    return set(got)


_MODELS: dict[str, tuple] = {}


def model_and_ref(model_type: str, device: str = "cpu"):
    key = f"{model_type}:{device}"
    if key not in _MODELS:
        model = tiny_model(model_type, attention_dropout=0.1 if model_type == "qwen3" else 0.0).train().to(device)
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
        _MODELS[key] = (model, ids, grads(model, ids))
    return _MODELS[key]


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(vector=VECTOR, prefetch=st.booleans())
def test_any_policy_vector_is_bit_exact_cpu(model_type, vector, prefetch):
    model, ids, ref = model_and_ref(model_type)
    assert check(model, ids, ref, vector, prefetch, "cpu") == set(ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(vector=VECTOR, prefetch=st.booleans())
def test_any_policy_vector_is_bit_exact_cuda(model_type, vector, prefetch):
    torch.use_deterministic_algorithms(True)
    try:
        model, ids, ref = model_and_ref(model_type, "cuda")
        again = grads(model, ids)
        assert all(torch.equal(ref[n], again[n]) for n in ref), "plain CUDA autograd is not deterministic here"
        assert check(model, ids, ref, vector, prefetch, "cuda") == set(ref)
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_uses_pinned_pool_and_frees_device():
    model, ids, ref = model_and_ref("qwen3", "cuda")
    engine = ActivationEngine(plan_for(model, [("offload_cpu", "gpu")] * 4), "cuda")
    assert engine.pin_memory and engine.pool.pin_memory
    handle = attach_standalone(model, engine, prefetch=False)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    torch.cuda.manual_seed(3)
    loss = model(ids, labels=ids).loss
    engine.synchronize()
    stats = engine.memory_stats()
    assert stats["gpu_bytes"] == 0 and stats["cpu_bytes"] > 0  # every D2H copy done, sources released
    loss.backward()
    engine.end_step()
    handle.remove()
    assert all(b.is_pinned() for bufs in engine.pool._free.values() for b, _ in bufs)
    engine.close()
