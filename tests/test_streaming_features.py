"""Streaming executor on CPU: memory bound, bf16 master/compute, LoRA, robustness and user errors."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_streaming import assert_grads_equal, padded_batch, plain_grads

from lazytrain_hf.planner.plan import Plan, PlanError
from lazytrain_hf.streaming import attach


# ---------------------------------------------------------------------------------------------------------- memory
def test_memory_high_water_mark_8_layers():
    """8 layers, layer weights dominating: the accounted device peak is ~2 slots + resident + activations + one
    layer's gradients, far below the unstreamed model (all weights + all gradients + activations)."""
    cfg = dict(num_hidden_layers=8, hidden_size=64, intermediate_size=512, vocab_size=64, head_dim=16)
    batch = padded_batch(batch=2, seq=8, vocab=64)
    model = tiny_model("qwen3", **cfg)
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    handle = attach(model)
    model(**batch).loss.backward()
    st = handle.memory_stats()
    slot = max(ls.nbytes for ls in handle.store.layers.values())
    assert st["slot_bytes"] == 2 * slot  # prefetch depth 1: two slots, never grown
    act = st["activation_gpu_peak_bytes"]
    assert act > 0
    layer_grad = max(ls.grad.numel() * 4 for ls in handle.store.layers.values())
    bound = 2 * slot + st["resident_bytes"] + act + layer_grad
    assert st["device_peak_bytes"] <= bound, (st, bound)
    unstreamed = 2 * weight_bytes + act  # weights + grads + activations
    assert st["device_peak_bytes"] < 0.45 * unstreamed, (st["device_peak_bytes"], unstreamed)
    assert st["host_grad_bytes"] >= sum(ls.grad.numel() * 4 for ls in handle.store.layers.values())
    handle.reset_peak()
    assert handle.memory_stats()["device_peak_bytes"] <= st["device_peak_bytes"]
    handle.remove()


# ---------------------------------------------------------------------------------------------------------- dtype
def test_bf16_master_compute_and_sync():
    """bf16 model: fp32 master = exact upcast, compute copy = the bf16 weights; after the master changes,
    sync_compute makes the next forward use the rounded new weights (bit-exact against a plain model)."""
    batch = padded_batch()
    model = tiny_model("qwen3").to(torch.bfloat16)
    ref = tiny_model("qwen3").to(torch.bfloat16)
    handle = attach(model)
    ls = handle.store.layers[1]
    assert not ls.aliased and ls.master.dtype == torch.float32
    for name, p in ls.params.items():
        assert torch.equal(ls.master_views[name], p.detach().float())
        assert torch.equal(ls.compute_views[name], p.detach())
    with torch.no_grad():
        ls.master.add_(0.01)
    handle.sync_compute(1)
    with torch.no_grad():
        for name, p in ref.model.layers[1].named_parameters(prefix="model.layers.1"):
            p.copy_(ls.master_views[name].to(torch.bfloat16))
    loss = model(**batch).loss
    ref_loss = ref(**batch).loss
    assert torch.equal(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    # host accumulators are fp32; the plain model's grads are bf16 (same values: one micro-batch, exact upcast)
    got = handle.grads()
    for n, g in plain_grads(ref).items():
        assert got[n].dtype == (torch.float32 if "layers." in n else torch.bfloat16)
        assert torch.equal(got[n], g.to(got[n].dtype)), n
    with pytest.raises(ValueError, match="sync_compute"):
        handle.sync_compute(99)
    handle.remove()


# ---------------------------------------------------------------------------------------------------------- LoRA
@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft reads a transformers property deprecated in 5.x
def test_lora_frozen_streamed_adapters_resident():
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4, lora_dropout=0.0)
    batch = padded_batch()

    def build():
        torch.manual_seed(0)
        base = tiny_model("qwen3", hidden_size=64, intermediate_size=256, head_dim=16)
        m = peft.get_peft_model(base, cfg)
        torch.manual_seed(5)
        with torch.no_grad():  # non-zero lora_B so every adapter gets a gradient path
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        return m

    ref = build()
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    ref_g = plain_grads(ref)
    assert all("lora_" in n for n in ref_g)

    model = build()
    handle = attach(model)
    ls = handle.store.layers[0]
    assert ls.grad is None and ls.master is None  # frozen weights only: no master, no grad buffer
    assert all(not e.trainable for e in ls.entries)
    assert sorted(ls.resident_trainable) == sorted(n for n in ref_g if ".layers.0." in n)
    loss = model(**batch).loss
    loss.backward()
    assert torch.equal(loss, ref_loss)
    assert_grads_equal(ref_g, handle.grads())
    assert handle.memory_stats()["host_grad_bytes"] == 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle.remove()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------------------------------------------- robustness
def test_exception_inside_layer_then_recovers():
    batch = padded_batch()
    ref = tiny_model("qwen3")
    ref(**batch).loss.backward()
    model = tiny_model("qwen3")
    handle = attach(model)

    def boom(module, args):
        raise RuntimeError("boom")

    h = model.model.layers[2].mlp.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        model(**batch)
    h.remove()
    model(**batch).loss.backward()
    assert_grads_equal(plain_grads(ref), handle.grads())
    assert handle.memory_stats()["slot_bytes"] == 2 * max(ls.nbytes for ls in handle.store.layers.values())
    handle.remove()


def test_backward_of_stale_forward_raises():
    batch = padded_batch()
    model = tiny_model("qwen3")
    handle = attach(model)
    stale = model(**batch).loss
    model(**batch).loss.backward()
    with pytest.raises(RuntimeError, match="older than the latest"):
        stale.backward()
    handle.remove()


def test_generate_matches_plain():
    model = tiny_model("qwen3", use_cache=True)
    ids = padded_batch(batch=1, seq=6)["input_ids"]
    ref = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    handle = attach(model)
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    handle.remove()
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------------------------------------- errors
def test_attach_errors():
    model = tiny_model("qwen3")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        attach("qwen3")
    with pytest.raises(TypeError, match="plan"):
        attach(model, plan={"layers": []})
    with pytest.raises(PlanError, match="4"):
        attach(model, plan=Plan.default(3))
    kinds = ["full_attention+moe"] * 4
    with pytest.raises(ValueError, match=r"plan.layers\[0\].kind='full_attention\+moe'"):
        attach(model, plan=Plan.default(4, kinds=kinds))
    with pytest.raises(TypeError, match="device"):
        attach(model, device=3)
    with pytest.raises(ValueError, match="device='tpu'|not a valid device|only 'cpu'"):
        attach(model, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            attach(model, device="cuda")
    with pytest.raises(TypeError, match="pin_memory"):
        attach(model, pin_memory="yes")
    handle = attach(model)
    with pytest.raises(ValueError, match="already has a streaming executor"):
        attach(model)
    with pytest.raises(TypeError, match="callable"):
        handle.on_layer_grads_ready(3)
    with pytest.raises(ValueError, match="labels"):
        handle.causal_lm_loss(model, {"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    handle.remove()
    # model state unchanged by the failed attaches
    assert all(p.grad is None for p in model.parameters())

    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        attach(model)


def test_unsupported_model_type():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1, vocab_size=32)
    with pytest.raises(ValueError, match="model_type='llama' is not supported"):
        attach(AutoModelForCausalLM.from_config(cfg))
