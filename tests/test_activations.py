"""Activation placement engine on CPU: every policy bit-exact vs plain autograd, layouts, pool, accounting, spill
files, errors.

On CPU the engine only moves data (copies into host buffers, files, back), so every gradient must be bit-identical
to the un-hooked model on the same batch and seed (`torch.equal`). The planner's cost model is compared with the
engine's measured bytes at the tolerance the issue states (10%).
"""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from conftest import tiny_model
from helpers.standalone import attach_standalone

from lazytrain_hf.activations import ActivationEngine, ActivationSpillError, HostBufferPool
from lazytrain_hf.activations import nvme as act
from lazytrain_hf.activations.nvme import IO_ALIGN
from lazytrain_hf.models import decoder_layers, layer_kinds
from lazytrain_hf.planner.plan import Plan
from lazytrain_hf.streaming.trace import Trace


# ---------------------------------------------------------------------------------------------------------- helpers
def make_plan(model: nn.Module, policies: list) -> Plan:
    """``policies``: per layer a policy name or ``("recompute", input_tier)``."""
    plan = Plan.default(model.config.num_hidden_layers, layer_kinds(model.config))
    for lp, p in zip(plan.layers, policies):
        lp.policy, lp.input_tier = p if isinstance(p, tuple) else (p, "gpu")
    return plan.validate()


def batch(b: int = 2, t: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(seed))


def run(model: nn.Module, ids: torch.Tensor, engine: ActivationEngine | None = None, seed: int = 7, **kw):
    """One forward + backward; returns (grads, loss, memory stats right after forward, stats after backward)."""
    model.zero_grad(set_to_none=True)
    handle = attach_standalone(model, engine, **kw) if engine is not None else None
    try:
        torch.manual_seed(seed)
        loss = model(ids, labels=ids).loss
        fwd = engine.memory_stats() if engine is not None else None
        loss.backward()
        bwd = engine.memory_stats() if engine is not None else None
        if engine is not None:
            engine.end_step()
    finally:
        if handle is not None:
            handle.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, loss.detach(), fwd, bwd


def assert_grads_equal(ref: dict, got: dict) -> None:
    assert sorted(ref) == sorted(got)
    bad = [n for n in ref if not torch.equal(ref[n], got[n])]
    detail = [(n, (ref[n] - got[n]).abs().max().item()) for n in bad[:5]]
    assert not bad, f"{len(bad)} gradients differ, first: {detail}"


POLICY_VECTORS = {
    "keep": ["keep"] * 4,
    "cpu": ["offload_cpu"] * 4,
    "nvme": ["offload_nvme"] * 4,
    "recompute_gpu": ["recompute"] * 4,
    "recompute_cpu": [("recompute", "cpu")] * 4,
    "recompute_nvme": [("recompute", "nvme")] * 4,
    "mixed": ["keep", "offload_cpu", ("recompute", "nvme"), "offload_nvme"],
    "mixed2": [("recompute", "cpu"), "offload_nvme", "keep", "recompute"],
}


@pytest.fixture(scope="module")
def refs():
    """Plain-autograd gradients per model type (computed once)."""
    out = {}
    for mt in ("qwen3", "qwen3_moe"):
        model = tiny_model(mt).train()
        out[mt] = (model, run(model, batch()))
    return out


# ---------------------------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize(
    "model_type,name", [("qwen3", n) for n in POLICY_VECTORS] + [("qwen3_moe", n) for n in ("cpu", "nvme", "mixed2")]
)
def test_policy_vector_bit_exact(refs, tmp_path, model_type, name):
    model, (ref_g, ref_loss, _, _) = refs[model_type]
    engine = ActivationEngine(make_plan(model, POLICY_VECTORS[name]), "cpu", nvme_dir=str(tmp_path))
    g, loss, fwd, after = run(model, batch(), engine)
    assert torch.equal(loss, ref_loss)
    assert_grads_equal(ref_g, g)
    # the tiers the plan names were really used (the per-layer record: right after forward, "cpu" bytes also
    # include NVMe staging buffers whose background write has not finished), and everything is given back after
    # the step
    tiers = engine.plan.tiers_used()
    stored = {t for per in engine.layer_bytes().values() for t in ("cpu", "nvme") if per[t] > 0}
    assert stored == tiers & {"cpu", "nvme"}
    assert (fwd["nvme_bytes"] > 0) == ("nvme" in tiers)
    if "cpu" in tiers:
        assert fwd["cpu_bytes"] > 0
    assert after["gpu_bytes"] == after["cpu_bytes"] == after["nvme_bytes"] == 0
    assert engine.spill_files() == []
    engine.close()


@pytest.mark.parametrize("name", ["cpu", "nvme", "recompute_nvme"])
def test_reload_on_demand_without_prefetch(refs, tmp_path, name):
    model, (ref_g, _, _, _) = refs["qwen3"]
    engine = ActivationEngine(make_plan(model, POLICY_VECTORS[name]), "cpu", nvme_dir=str(tmp_path))
    g, *_ = run(model, batch(), engine, prefetch=False)
    assert_grads_equal(ref_g, g)
    engine.close()


def test_prefetch_follows_issue_schedule(refs, tmp_path):
    model, (ref_g, _, _, _) = refs["qwen3"]
    plan = make_plan(model, ["offload_cpu", ("recompute", "nvme"), "keep", "offload_nvme"])
    plan.layers[0].reload_ahead = 3
    plan.layers[3].reload_ahead = 0
    engine = ActivationEngine(plan, "cpu", nvme_dir=str(tmp_path))
    handle = attach_standalone(model, engine)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    model(batch(), labels=batch()).loss.backward()
    engine.end_step()
    handle.remove()
    expected = [(s, i) for s, items in sorted(plan.issue_schedule().items()) for what, i in items if what == "reload"]
    assert handle.issued == expected == [(5, 3), (5, 0), (6, 1)]  # B3 = stage 5, B1 = 7, B0 = 8
    assert_grads_equal(ref_g, {n: p.grad for n, p in model.named_parameters()})
    engine.close()


def test_recompute_with_dropout_matches_keep(tmp_path):
    """attention_dropout=0.5 in train mode: recompute replays the RNG, so dropout masks (and gradients) match."""
    model = tiny_model("qwen3", attention_dropout=0.5).train()
    ids = batch()
    ref_g, *_ = run(model, ids, seed=7)
    other_g, *_ = run(model, ids, seed=8)
    assert any(not torch.equal(ref_g[n], other_g[n]) for n in ref_g), "dropout is not active: the test is void"
    for name in ("keep", "recompute_gpu", "recompute_cpu", "recompute_nvme", "mixed2"):
        engine = ActivationEngine(make_plan(model, POLICY_VECTORS[name]), "cpu", nvme_dir=str(tmp_path))
        g, *_ = run(model, ids, engine, seed=7)
        assert_grads_equal(ref_g, g)
        engine.close()


def test_recompute_leaves_training_rng_and_module_hooks_alone(refs):
    model, (ref_g, _, _, _) = refs["qwen3"]
    calls = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: calls.append(1)) for layer in decoder_layers(model)]
    engine = ActivationEngine(make_plan(model, POLICY_VECTORS["recompute_gpu"]), "cpu")
    try:
        g, *_ = run(model, batch(), engine, seed=7)
        after_engine = torch.get_rng_state()
        run(model, batch(), seed=7)
        after_plain = torch.get_rng_state()
    finally:
        for h in hooks:
            h.remove()
    assert_grads_equal(ref_g, g)
    assert len(calls) == 2 * 4  # once per layer per run: the recomputation calls module.forward, not module(...)
    assert torch.equal(after_engine, after_plain)  # fork_rng: recomputation draws do not advance the training RNG
    engine.close()


def test_retain_graph_second_backward(refs, tmp_path):
    """Two backwards over one retained graph: offloaded tensors stay reloadable, recompute runs once per backward."""
    model, _ = refs["qwen3_moe"]
    ids = batch()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    loss = model(ids, labels=ids).loss
    loss.backward(retain_graph=True)
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    engine = ActivationEngine(make_plan(model, POLICY_VECTORS["mixed"]), "cpu", nvme_dir=str(tmp_path))
    handle = attach_standalone(model, engine)
    model.zero_grad(set_to_none=True)
    with engine.step():
        torch.manual_seed(7)
        loss = model(ids, labels=ids).loss
        loss.backward(retain_graph=True)
        loss.backward()
        del loss
    handle.remove()
    assert_grads_equal(ref, {n: p.grad for n, p in model.named_parameters()})
    engine.close()


def test_eval_forward_saves_nothing(refs, tmp_path):
    model, _ = refs["qwen3"]
    engine = ActivationEngine(make_plan(model, POLICY_VECTORS["mixed"]), "cpu", nvme_dir=str(tmp_path))
    handle = attach_standalone(model, engine)
    with torch.no_grad():
        out = model(batch()).logits
    handle.remove()
    with torch.no_grad():
        ref = model(batch()).logits
    assert torch.equal(out, ref)
    assert engine.memory_stats()["cpu_peak_bytes"] == engine.memory_stats()["gpu_peak_bytes"] == 0
    assert engine.spill_files() == []
    engine.close()


def test_handle_remove_restores_hooks(refs):
    model, _ = refs["qwen3"]

    def counts():
        return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]

    before = counts()
    engine = ActivationEngine(make_plan(model, POLICY_VECTORS["keep"]), "cpu")
    handle = attach_standalone(model, engine)
    assert counts() != before
    assert "StandaloneHandle(layers=4" in repr(handle) and "keep=4" in repr(engine)
    handle.remove()
    assert counts() == before
    engine.close()


# ---------------------------------------------------------------------------------------------------------- packer
class SlotPacker:
    """A `ParamPacker` like the executor's: weights become (name, offset, size, stride) references and are rebuilt on
    the parameter's *current* storage, which the test swaps between forward and backward (a re-fetched slot)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = dict(model.named_parameters())
        self.packed = 0
        self.unpacked_ptrs: set[int] = set()

    def pack(self, t: torch.Tensor) -> object | None:
        ptr = t.untyped_storage().data_ptr()
        for name, p in self.params.items():
            if p.untyped_storage().data_ptr() == ptr:
                self.packed += 1
                return (name, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        return None

    def unpack(self, ref: object) -> torch.Tensor:
        name, off, size, stride = ref
        p = self.params[name].detach()
        self.unpacked_ptrs.add(p.untyped_storage().data_ptr())
        return p.as_strided(size, stride, off)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_param_packer_references_weights(refs, tmp_path, model_type):
    model, (ref_g, _, _, _) = refs[model_type]
    # the same bytes are stored with and without a packer: weights never reach a tier either way
    plain = ActivationEngine(make_plan(model, POLICY_VECTORS["cpu"]), "cpu")
    _, _, fwd_plain, _ = run(model, batch(), plain)
    plain.close()

    packer = SlotPacker(model)
    engine = ActivationEngine(make_plan(model, POLICY_VECTORS["mixed"]), "cpu", str(tmp_path), param_packer=packer)
    handle = attach_standalone(model, engine)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    loss = model(batch(), labels=batch()).loss
    old = [p.data for p in model.parameters()]  # kept alive: their addresses cannot be reused by the clones
    for p in model.parameters():  # "re-fetch into another slot": same values, new storage
        p.data = p.data.clone()
    loss.backward()
    engine.end_step()
    handle.remove()
    assert packer.packed > 0
    assert packer.unpacked_ptrs and not (packer.unpacked_ptrs & {o.untyped_storage().data_ptr() for o in old})
    assert_grads_equal(ref_g, {n: p.grad for n, p in model.named_parameters()})
    engine.close()

    cpu_only = ActivationEngine(make_plan(model, POLICY_VECTORS["cpu"]), "cpu", param_packer=SlotPacker(model))
    _, _, fwd_packed, _ = run(model, batch(), cpu_only)
    assert fwd_packed["cpu_bytes"] == fwd_plain["cpu_bytes"] > 0
    cpu_only.close()


# ---------------------------------------------------------------------------------------------------------- layouts
class SaveAndCheck(torch.autograd.Function):
    """Saves ``t``; backward records the unpacked tensor."""

    seen: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx, dummy, t):
        ctx.save_for_backward(t)
        return dummy.clone()

    @staticmethod
    def backward(ctx, grad):
        (t,) = ctx.saved_tensors
        SaveAndCheck.seen.append(t)
        return grad, None


def _layout_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g)
    big = torch.randn(64, 33, generator=g)
    return {
        "contiguous": torch.randn(3, 5, 7, generator=g),
        "transposed": base.t(),
        "expanded": torch.randn(5, 1, generator=g).expand(5, 8),
        "chunk_gapped": big[:, 16:],  # offset 16, rows of 17 with a gap: copied as the whole storage
        "narrow_small": big[1:3, 5:9],  # a small gapped view of a big storage: compact copy
        "offset_dense": base.view(-1)[3:33].view(5, 6),  # storage offset 3: alignment phase kept
        "scalar": torch.tensor(2.5),
        "bf16": torch.randn(4, 9, generator=g).to(torch.bfloat16),
        "int64": torch.randint(0, 100, (7, 3), generator=g),
        "bool": torch.rand(5, 5, generator=g) > 0.5,
        "overlapping": torch.arange(12.0).as_strided((4, 4), (2, 1)),
    }


@pytest.mark.parametrize("tier", ["offload_cpu", "offload_nvme"])
@pytest.mark.parametrize("case", list(_layout_cases()))
def test_saved_tensor_round_trip_layout(tmp_path, tier, case):
    t = _layout_cases()[case]
    plan = Plan.default(1)
    plan.layers[0].policy = tier
    engine = ActivationEngine(plan, "cpu", nvme_dir=str(tmp_path))
    module = nn.Linear(2, 2)
    dummy = torch.zeros(3, requires_grad=True)
    SaveAndCheck.seen.clear()
    with engine.step():
        engine.begin_layer(0, module, (dummy,), {})
        out = SaveAndCheck.apply(dummy, t)
        engine.end_layer(0)
        stats = engine.memory_stats()
        out.sum().backward()
    (u,) = SaveAndCheck.seen
    assert u.dtype == t.dtype and u.shape == t.shape and u.stride() == t.stride()
    align = max(1, 64 // t.element_size())
    assert u.storage_offset() % align == t.storage_offset() % align
    assert torch.equal(u, t)
    if case != "overlapping" or tier == "offload_cpu":
        assert stats["cpu_bytes" if tier == "offload_cpu" else "nvme_bytes"] > 0
    if case == "chunk_gapped":  # whole storage copied: the restored view sits at the very same offset
        assert (
            u.storage_offset() == t.storage_offset() and u.untyped_storage().nbytes() == t.untyped_storage().nbytes()
        )
    if case == "narrow_small":  # compact copy: only the viewed elements went to the tier
        assert stats["cpu_bytes" if tier == "offload_cpu" else "nvme_bytes"] == t.numel() * t.element_size()
    engine.close()


def test_views_of_one_storage_are_copied_once(tmp_path):
    """Two views of one storage (4-D attention output and its 2-D reshape) share one host copy."""
    plan = Plan.default(1)
    plan.layers[0].policy = "offload_cpu"
    engine = ActivationEngine(plan, "cpu")
    x = torch.randn(2, 4, 16, 8)
    a = x.transpose(1, 2)  # (2, 16, 4, 8) non-contiguous view
    b = x.view(32, 32)
    dummy = torch.zeros(1, requires_grad=True)
    SaveAndCheck.seen.clear()
    with engine.step():
        engine.begin_layer(0, nn.Linear(1, 1), (dummy,), {})
        o1, o2 = SaveAndCheck.apply(dummy, a), SaveAndCheck.apply(dummy, b)
        engine.end_layer(0)
        assert engine.memory_stats()["cpu_bytes"] == x.numel() * 4
        (o1 + o2).sum().backward()
    assert sorted(tuple(u.shape) for u in SaveAndCheck.seen) == [(2, 16, 4, 8), (32, 32)]
    for u, t in zip(sorted(SaveAndCheck.seen, key=lambda u: u.dim()), [b, a]):
        assert u.stride() == t.stride() and torch.equal(u, t)
    engine.close()


@pytest.mark.sync_engine  # Note: [Saved tensors are not written in place while their copy runs]
def test_modified_storage_is_copied_again():
    """An in-place write between two saves (version counter moved) must not be served from the first copy."""
    plan = Plan.default(1)
    plan.layers[0].policy = "offload_cpu"
    engine = ActivationEngine(plan, "cpu")
    x = torch.ones(64)
    dummy = torch.zeros(1, requires_grad=True)
    SaveAndCheck.seen.clear()
    with engine.step():
        engine.begin_layer(0, nn.Linear(1, 1), (dummy,), {})
        o1 = SaveAndCheck.apply(dummy, x)
        x.mul_(3)
        o2 = SaveAndCheck.apply(dummy, x)
        engine.end_layer(0)
        (o1 + o2).sum().backward()
    values = sorted(float(u[0]) for u in SaveAndCheck.seen)
    assert values == [1.0, 3.0]
    engine.close()


# ---------------------------------------------------------------------------------------------------------- pool
def test_host_pool_does_not_grow_after_first_step(refs, tmp_path):
    """CPU tier (and recompute inputs on it): the buffers of step 1 serve every later step."""
    model, (ref_g, _, _, _) = refs["qwen3"]
    engine = ActivationEngine(make_plan(model, ["offload_cpu", ("recompute", "cpu"), "offload_cpu", "keep"]), "cpu")
    sizes = []
    for _ in range(3):
        g, *_ = run(model, batch(), engine)
        assert_grads_equal(ref_g, g)
        sizes.append((engine.pool.allocated_bytes, engine.pool.num_allocations))
    assert sizes[0][0] > 0
    assert sizes[0] == sizes[1] == sizes[2], sizes
    engine.close()
    assert engine.pool.allocated_bytes == 0


def test_nvme_staging_is_bounded(refs, tmp_path):
    """NVMe staging buffers are recycled as writes complete; in flight they stay under the configured bound."""
    model, (ref_g, _, _, _) = refs["qwen3"]
    limit = 16 << 10
    engine = ActivationEngine(
        make_plan(model, POLICY_VECTORS["nvme"]), "cpu", nvme_dir=str(tmp_path), nvme_max_inflight_bytes=limit
    )
    stores = []
    real_store = engine._nvme.store
    engine._nvme.store = lambda layer, t, layout: (stores.append(layout.nbytes), real_store(layer, t, layout))[1]
    for _ in range(3):
        g, _, fwd, _ = run(model, batch(), engine)
        assert_grads_equal(ref_g, g)
        # staging of writes in flight: the bound, plus one tensor admitted when nothing else is in flight
        assert engine.memory_stats()["cpu_peak_bytes"] <= limit + 8192
    # recycled: the pool holds a fraction of what the step's tensors would need with one (aligned) staging buffer
    # each (a staging buffer holds an IO_ALIGN-aligned region: See Note: [Spilled bytes leave RAM])
    per_step = stores[: len(stores) // 3]
    one_each = sum(HostBufferPool.bucket(-(-n // IO_ALIGN) * IO_ALIGN + IO_ALIGN) for n in per_step)
    assert 0 < engine.pool.allocated_bytes < one_each / 4, (engine.pool.allocated_bytes, one_each, len(per_step))
    engine.close()


def test_host_pool_buckets_and_reuse():
    pool = HostBufferPool()
    a = pool.get(100)
    assert a.numel() == 512 and a.dtype == torch.uint8 and not a.is_pinned()
    pool.put(a)
    b = pool.get(300)
    assert b.data_ptr() == a.data_ptr() and pool.num_allocations == 1
    c = pool.get(513)
    assert c.numel() == 1024 and pool.allocated_bytes == 1536
    pool.put(b)
    pool.put(c)
    assert pool.cached_bytes == 1536
    pool.clear()
    assert pool.allocated_bytes == 0 and "HostBufferPool(pin_memory=False" in repr(pool)


# ---------------------------------------------------------------------------------------------------------- accounting
def independent_saved_bytes(model: nn.Module, ids: torch.Tensor) -> list[int]:
    """Per layer: bytes of unique non-parameter, non-shared storages autograd saves (a separate plain hook)."""
    layers = decoder_layers(model)
    per_layer: list[int] = []
    seen: set[int] = set()
    state = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in state["skip"] and ptr not in seen:
            seen.add(ptr)
            per_layer[-1] += t.untyped_storage().nbytes()
        return t

    def pre(m, args, kwargs):
        skip = {p.untyped_storage().data_ptr() for p in m.parameters()}
        for v in list(args[1:]) + [v for k, v in kwargs.items() if k != "hidden_states"]:
            for t in v if isinstance(v, tuple) else (v,):
                if isinstance(t, torch.Tensor):
                    skip.add(t.untyped_storage().data_ptr())
        state["skip"] = skip
        per_layer.append(0)
        state["ctx"] = torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x)
        state["ctx"].__enter__()

    def post(m, args, out):
        state["ctx"].__exit__(None, None, None)

    hs = [h for layer in layers for h in (layer.register_forward_pre_hook(pre, with_kwargs=True),
                                          layer.register_forward_hook(post))]  # fmt: skip
    try:
        torch.manual_seed(7)
        model(ids, labels=ids).loss.backward()
    finally:
        for h in hs:
            h.remove()
    return per_layer


@pytest.mark.sync_engine  # exact tier figures right after forward: no copy may still be in flight
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_memory_stats_per_tier_match_independent_count(refs, tmp_path, model_type):
    model, _ = refs[model_type]
    ids = batch()
    per_layer = independent_saved_bytes(model, ids)
    total = sum(per_layer)
    for name, tier_key in (("keep", "gpu_bytes"), ("cpu", "cpu_bytes"), ("nvme", "nvme_bytes")):
        engine = ActivationEngine(make_plan(model, POLICY_VECTORS[name]), "cpu", nvme_dir=str(tmp_path))
        _, _, fwd, _ = run(model, ids, engine)
        engine.synchronize()
        assert fwd[tier_key] == total, (name, fwd, per_layer)
        layer_bytes = engine.layer_bytes()
        assert [layer_bytes[i][tier_key.split("_")[0]] for i in range(4)] == per_layer
        if name != "keep":
            # at the end of forward (stage H) only the reload of the last layer (reload_ahead=1) was issued
            assert fwd["gpu_bytes"] == per_layer[3]
            # backward holds the current layer's reload and the next one's (reload_ahead=1): two layers at most
            assert engine.memory_stats()["gpu_peak_bytes"] == per_layer[3] + per_layer[2]
        engine.close()


def _predicted_gpu_peak(plan: Plan, keep_bytes: list[int], input_bytes: list[int]) -> int:
    """Device bytes of saved activations at the worst stage, from per-layer byte counts and the plan's stages:
    at rest, layer j holds keep_j (keep), input_j (recompute with input on the gpu) or nothing; in B_i layer i holds
    keep_i (kept, reloaded or recomputed) and layers whose reload was issued by then hold what they reload."""
    L = plan.num_layers
    issued = {i: max(0, (2 * L - i) - plan.layers[i].reload_ahead) for i in range(L)}

    def at_rest(j: int) -> int:
        lp = plan.layers[j]
        return keep_bytes[j] if lp.policy == "keep" else input_bytes[j] if lp.tier == "gpu" else 0

    def reloaded(j: int) -> int:
        return keep_bytes[j] if plan.layers[j].policy.startswith("offload") else input_bytes[j]

    peak = sum(at_rest(j) for j in range(L))  # end of forward
    for i in reversed(range(L)):
        stage = 2 * L - i
        held = sum(at_rest(j) for j in range(i)) + keep_bytes[i]
        held += sum(reloaded(j) for j in range(i) if plan.layers[j].tier != "gpu" and issued[j] <= stage)
        peak = max(peak, held)
    return peak


@pytest.mark.sync_engine  # the cost model counts an offloaded tensor off the device once saved (no copy in flight)
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("name", ["keep", "cpu", "recompute_gpu", "mixed", "mixed2"])
def test_gpu_peak_matches_costmodel(tmp_path, model_type, name):
    """Measured device high-water mark vs the planner's cost model (`saved_activation_bytes`) within 10%."""
    from lazytrain_hf.planner import costmodel

    model = tiny_model(model_type).train()
    B, T = 2, 16
    ids = batch(B, T)
    plan = make_plan(model, POLICY_VECTORS[name])
    engine = ActivationEngine(plan, "cpu", nvme_dir=str(tmp_path))
    run(model, ids, engine)
    measured = engine.memory_stats()["gpu_peak_bytes"]
    cfg, attn = model.config, model.config._attn_implementation
    keep = [costmodel.saved_activation_bytes(cfg, i, "keep", B, T, 4, attn) for i in range(4)]
    inp = [costmodel.saved_activation_bytes(cfg, i, "recompute", B, T, 4, attn) for i in range(4)]
    predicted = _predicted_gpu_peak(plan, keep, inp)
    assert abs(measured - predicted) <= 0.10 * predicted, (name, measured, predicted)
    engine.close()


# ---------------------------------------------------------------------------------------------------------- spill files
def test_spill_files_exist_during_step_and_are_gone_after(refs, tmp_path):
    model, _ = refs["qwen3"]
    engine = ActivationEngine(make_plan(model, POLICY_VECTORS["nvme"]), "cpu", nvme_dir=str(tmp_path))
    handle = attach_standalone(model, engine)
    with engine.step():
        loss = model(batch(), labels=batch()).loss
        engine.synchronize()
        files = engine.spill_files()
        assert len(files) == 4 and all(os.path.getsize(os.path.join(engine.spill_dir, f)) > 0 for f in files)
        assert (os.stat(engine.spill_dir).st_mode & 0o777) == 0o700
        assert os.path.dirname(engine.spill_dir) == str(tmp_path)
        loss.backward()
        del loss
    assert engine.spill_files() == []
    handle.remove()
    spill_dir = engine.spill_dir
    engine.close()
    assert not os.path.exists(spill_dir) and os.listdir(tmp_path) == []
    engine.close()  # idempotent


def test_spill_files_gone_after_exception_in_step(refs, tmp_path):
    model, (ref_g, _, _, _) = refs["qwen3"]
    engine = ActivationEngine(make_plan(model, POLICY_VECTORS["mixed"]), "cpu", nvme_dir=str(tmp_path))
    handle = attach_standalone(model, engine)
    with pytest.raises(RuntimeError, match="boom"):
        with engine.step():
            _ = model(batch(), labels=batch()).loss
            assert engine.spill_files()
            raise RuntimeError("boom")
    assert engine.spill_files() == []
    st = engine.memory_stats()
    assert st["gpu_bytes"] == st["cpu_bytes"] == st["nvme_bytes"] == 0

    # an exception raised inside a layer's forward: hooks are exited, files removed, the engine keeps working
    mlp = decoder_layers(model)[2].mlp
    orig = mlp.forward
    mlp.forward = lambda *a, **k: (_ for _ in ()).throw(ValueError("inside layer 2"))
    try:
        with pytest.raises(ValueError, match="inside layer 2"):
            with engine.step():
                _ = model(batch(), labels=batch()).loss
    finally:
        mlp.forward = orig
    assert engine.spill_files() == [] and engine._stack == []
    handle.remove()
    g, *_ = run(model, batch(), engine)
    assert_grads_equal(ref_g, g)
    engine.close()


def test_unpack_after_end_step_raises(refs, tmp_path):
    model, _ = refs["qwen3"]
    for name in ("keep", "nvme", "recompute_gpu"):
        engine = ActivationEngine(make_plan(model, POLICY_VECTORS[name]), "cpu", nvme_dir=str(tmp_path))
        handle = attach_standalone(model, engine)
        loss = model(batch(), labels=batch()).loss
        engine.end_step()
        with pytest.raises(RuntimeError, match="released by end_step"):
            loss.backward()
        handle.remove()
        engine.close()


def test_write_failure_raises_and_removes_files(refs, tmp_path, monkeypatch):
    model, (ref_g, _, _, _) = refs["qwen3"]
    engine = ActivationEngine(make_plan(model, POLICY_VECTORS["mixed"]), "cpu", nvme_dir=str(tmp_path))
    calls = {"n": 0}
    real = act._pwrite

    def failing(fd, data, offset):
        calls["n"] += 1
        if calls["n"] >= 3:  # a few writes succeed, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(act, "_pwrite", failing)
    handle = attach_standalone(model, engine)
    with pytest.raises(ActivationSpillError) as info:
        with engine.step():
            model(batch(), labels=batch()).loss.backward()
    handle.remove()
    e = info.value
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC
    msg = str(e)
    assert f"activation_nvme_dir={str(tmp_path)!r}" in msg and "bytes" in msg and "free" in msg
    assert any(ch.isdigit() for ch in msg.split("writing")[1].split("bytes")[0])
    assert engine.spill_files() == []
    # a short write (0 bytes written) is a full disk as well
    monkeypatch.setattr(act, "_pwrite", lambda fd, data, offset: 0)
    handle = attach_standalone(model, engine)
    with pytest.raises(ActivationSpillError, match="No space left"):
        with engine.step():
            model(batch(), labels=batch()).loss.backward()
    handle.remove()
    assert engine.spill_files() == []
    # the disk has space again: the same engine trains bit-exactly
    monkeypatch.setattr(act, "_pwrite", real)
    g, *_ = run(model, batch(), engine)
    assert_grads_equal(ref_g, g)
    engine.close()


def test_garbage_collected_engine_removes_its_directory(refs, tmp_path):
    model, _ = refs["qwen3"]
    engine = ActivationEngine(make_plan(model, POLICY_VECTORS["nvme"]), "cpu", nvme_dir=str(tmp_path))
    handle = attach_standalone(model, engine)
    loss = model(batch(), labels=batch()).loss
    engine.synchronize()
    assert engine.spill_files()
    handle.remove()
    del loss, engine, handle
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_stale_directories_of_dead_processes_are_removed(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    host = act._host_id()
    dead = tmp_path / f"lazytrain-act_{host}_{proc.pid}_0_abcd1234"
    reused = tmp_path / f"lazytrain-act_{host}_{os.getpid()}_1_abcd1234"  # our pid, another start time
    mine = tmp_path / f"lazytrain-act_{host}_{os.getpid()}_{act._process_start_ticks(os.getpid())}_abcd1234"
    other_host = tmp_path / f"lazytrain-act_00000000_{proc.pid}_0_abcd1234"
    unrelated = tmp_path / "keepme"
    for d in (dead, reused, mine, other_host, unrelated):
        d.mkdir()
        (d / "step0_layer0000.act").write_bytes(b"x" * 10)
    ActivationEngine(Plan.default(1), "cpu", nvme_dir=str(tmp_path)).close()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([mine.name, other_host.name, unrelated.name])


# ---------------------------------------------------------------------------------------------------------- errors
def test_constructor_errors(tmp_path, monkeypatch):
    plan = Plan.default(2)
    # pinned memory on the CPU only exists under the simulation (lazytrain_hf.pinned); outside it, it is an error
    monkeypatch.setenv("LAZYTRAIN_SIMULATE_ASYNC", "0")
    with pytest.raises(TypeError, match="plan must be a lazytrain_hf Plan"):
        ActivationEngine([], "cpu")
    with pytest.raises(ValueError, match="device='meta' is not supported"):
        ActivationEngine(plan, "meta")
    with pytest.raises(ValueError, match="device='banana' is not a torch device"):
        ActivationEngine(plan, "banana")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            ActivationEngine(plan, "cuda")
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            ActivationEngine(plan, "cpu", pin_memory=True)
    with pytest.raises(TypeError, match="param_packer=int does not implement"):
        ActivationEngine(plan, "cpu", param_packer=3)
    with pytest.raises(ValueError, match="io_threads=0"):
        ActivationEngine(plan, "cpu", io_threads=0)
    nv = Plan.default(2)
    nv.layers[1].policy = "offload_nvme"
    with pytest.raises(ValueError, match=r"layers \[1\] on the nvme tier but activation_nvme_dir=None"):
        ActivationEngine(nv, "cpu")
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="does not exist"):
        ActivationEngine(nv, "cpu", nvme_dir=missing)
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="is not writable"):
            ActivationEngine(nv, "cpu", nvme_dir=str(ro))


def test_check_nvme_capacity(tmp_path, monkeypatch):
    nv = Plan.default(1)
    nv.layers[0].policy = "offload_nvme"
    engine = ActivationEngine(nv, "cpu", nvme_dir=str(tmp_path))
    engine.check_nvme_capacity(1 << 20)
    with pytest.raises(ValueError) as info:
        engine.check_nvme_capacity(1 << 62)
    msg = str(info.value)
    assert str(tmp_path) in msg and str(1 << 62) in msg and "free" in msg
    monkeypatch.setattr(act.shutil, "disk_usage", lambda p: _Usage(1000))
    with pytest.raises(ValueError, match="has 1000 bytes"):
        engine.check_nvme_capacity(5000)
    with pytest.raises(ValueError, match="bytes_needed=-1"):
        engine.check_nvme_capacity(-1)
    engine.close()
    with pytest.raises(ValueError, match="activation_nvme_dir=None"):
        ActivationEngine(Plan.default(1), "cpu").check_nvme_capacity(10)


class _Usage:
    def __init__(self, free: int) -> None:
        self.total, self.used, self.free = free, 0, free


def test_layer_call_errors(refs):
    model, _ = refs["qwen3"]
    engine = ActivationEngine(make_plan(model, POLICY_VECTORS["keep"]), "cpu")
    layer = decoder_layers(model)[0]
    with pytest.raises(ValueError, match="layer=9 is out of range"):
        engine.begin_layer(9, layer, (), {})
    with pytest.raises(ValueError, match="layer=-1 is out of range"):
        engine.prefetch(-1)
    with pytest.raises(RuntimeError, match="does not match the open layers"):
        engine.end_layer(0)
    layer.gradient_checkpointing = True
    try:
        with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
            engine.begin_layer(0, layer, (torch.zeros(1),), {})
    finally:
        layer.gradient_checkpointing = False
    rec = ActivationEngine(make_plan(model, POLICY_VECTORS["recompute_gpu"]), "cpu")
    with pytest.raises(ValueError, match="neither args\\[0\\] nor kwargs\\['hidden_states'\\]"):
        rec.begin_layer(0, layer, (), {"x": 1})
    with pytest.raises(ValueError, match="the plan has 2 layers but the model has 4"):
        attach_standalone(model, ActivationEngine(Plan.default(2), "cpu"))
    engine.close()
    with pytest.raises(RuntimeError, match="after close"):
        engine.begin_layer(0, layer, (), {})


# ---------------------------------------------------------------------------------------------------------- release
class _CountingTrace(Trace):
    """The executor's trace, keeping every ``host_sync`` reason in order."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def host_sync(self, reason: str, step: int | None = None) -> None:
        self.reasons.append(reason)
        super().host_sync(reason, step)


@pytest.mark.parametrize("name", ["cpu", "nvme", "mixed", "recompute_cpu"])
def test_release_does_not_block_on_reload_events(refs, tmp_path, monkeypatch, name):
    """Releasing a consumed reload (autograd dropping its saved tensor) never waits on the reload's event: the
    compute side already waited (See Note: [Released reloads free behind their copy]). Gradients stay bit-exact
    under the simulated engine, and the host blocking points left are a spilling step's end, counted by the trace."""
    from lazytrain_hf import streams
    from lazytrain_hf.activations import tiers

    model, (ref_g, _, _, _) = refs["qwen3"]
    blocked_in_release: list[str] = []
    real_sync = streams.SimEvent.synchronize

    def synchronize(ev):
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code is tiers.Tier._release_reload.__code__:
                blocked_in_release.append(repr(ev))
                break
            frame = frame.f_back
        return real_sync(ev)

    monkeypatch.setattr(streams.SimEvent, "synchronize", synchronize)
    engine = ActivationEngine(make_plan(model, POLICY_VECTORS[name]), "cpu", nvme_dir=str(tmp_path))
    if not engine._tiers.is_async:
        pytest.skip("needs the simulated asynchronous engine (reload events)")
    trace = _CountingTrace()
    engine.set_trace(trace)
    for _ in range(2):
        g, *_ = run(model, batch(), engine)
        assert_grads_equal(ref_g, g)
    assert blocked_in_release == []
    assert not [r for r in trace.reasons if "released before use" in r], trace.reasons
    assert all(r.startswith("activations: ") for r in trace.reasons), trace.reasons
    # Note: [The end of a step does not block the host]: only a step that spilled waits, before removing its files
    spills = any(lp.tier == "nvme" for lp in engine.plan.layers)
    assert bool(trace.reasons) == spills, (name, trace.reasons)
    engine.close()
