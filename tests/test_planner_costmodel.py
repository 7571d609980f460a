"""Cost model: the saved-activation formulas equal what autograd really saves; parameter counts equal the real
modules; time overrides; input errors."""

from __future__ import annotations

import weakref
from collections import defaultdict

import pytest
import torch

from lazytrain_hf.models import layer_kinds
from lazytrain_hf.planner.costmodel import CostModel, layer_compute_terms, layer_param_count, saved_activation_bytes
from lazytrain_hf.planner.hardware import get_profile
from lazytrain_hf.planner.zoo import ZOO_MODELS, as_hf_config, get_config

transformers = pytest.importorskip("transformers")


def _tiny(model_type: str, **kw):
    base = dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        use_cache=False,
    )
    if model_type == "qwen3_moe":
        base.update(moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    if model_type == "qwen3_5_text":
        base.update(
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        )
    if model_type == "qwen2":
        base.pop("head_dim")
    base.update(kw)
    return transformers.AutoConfig.for_model(model_type, **base)


def measure_saved_bytes(config, batch: int, seq: int, dtype: torch.dtype) -> dict[int, int]:
    """Bytes each decoder layer saves for backward: unique storages packed by `saved_tensors_hooks` while the layer
    runs and still held when the forward ends (a graph branch whose output is dropped, such as the delta rule's final
    state, frees what it saved), parameters and the shared rotary cos/sin (layer inputs other than hidden_states)
    excluded."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current: list[int | None] = [None]
    shared: set[int] = set()
    packed: dict[int, list[tuple[int, int, weakref.ref]]] = defaultdict(list)

    def pre(i, kwargs):
        # Only this call's inputs are shared: an address freed by an earlier layer may be reused by a saved tensor.
        current[0] = i
        shared.clear()
        for k, v in kwargs.items():
            tensors = v if isinstance(v, tuple) else (v,)
            for t in tensors:
                if isinstance(t, torch.Tensor) and k != "hidden_states":
                    shared.add(t.untyped_storage().data_ptr())

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, k, i=i: pre(i, k), with_kwargs=True))
        handles.append(layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))

    def pack(t):
        i = current[0]
        if i is not None:
            s = t.untyped_storage()
            if s.data_ptr() not in params and s.data_ptr() not in shared:
                packed[i].append((s.data_ptr(), s.nbytes(), weakref.ref(t)))
        return t

    ids = torch.randint(0, config.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    for h in handles:
        h.remove()
    result = {i: sum({ptr: n for ptr, n, ref in v if ref() is not None}.values()) for i, v in packed.items()}
    del out
    return result


@pytest.mark.parametrize(
    "model_type,attn,dtype,batch,seq",
    [
        ("qwen3", "sdpa", torch.bfloat16, 2, 64),
        ("qwen3", "sdpa", torch.float32, 3, 40),
        ("qwen3", "eager", torch.bfloat16, 2, 64),
        ("qwen3_moe", "sdpa", torch.bfloat16, 2, 64),
        ("qwen3_moe", "sdpa", torch.float32, 1, 48),
        ("qwen2", "sdpa", torch.bfloat16, 2, 32),
        ("qwen3_5_text", "sdpa", torch.bfloat16, 2, 64),
        ("qwen3_5_text", "sdpa", torch.bfloat16, 1, 96),
        ("qwen3_5_text", "sdpa", torch.bfloat16, 2, 130),
    ],
)
def test_saved_bytes_formula_matches_autograd(model_type, attn, dtype, batch, seq):
    config = _tiny(model_type, attn_implementation=attn)
    measured = measure_saved_bytes(config, batch, seq, dtype)
    db = torch.tensor([], dtype=dtype).element_size()
    kinds = layer_kinds(config)
    for i in range(config.num_hidden_layers):
        predicted = saved_activation_bytes(config, i, "keep", batch, seq, db, attn_implementation=attn)
        assert predicted == measured[i], (
            f"{model_type} layer {i} ({kinds[i]}): formula {predicted} B, autograd saved {measured[i]} B "
            f"(diff {predicted - measured[i]:+d})"
        )


def test_saved_bytes_per_policy():
    config = _tiny("qwen3")
    keep = saved_activation_bytes(config, 0, "keep", 2, 64, 2)
    assert saved_activation_bytes(config, 0, "recompute", 2, 64, 2) == 2 * 64 * 64 * 2
    assert saved_activation_bytes(config, 0, "offload_cpu", 2, 64, 2) == 0
    assert saved_activation_bytes(config, 0, "offload_nvme", 2, 64, 2) == 0
    assert keep > 2 * 64 * 64 * 2
    with pytest.raises(ValueError, match="policy='bogus'"):
        saved_activation_bytes(config, 0, "bogus", 2, 64, 2)
    with pytest.raises(ValueError, match="layer_index=5"):
        saved_activation_bytes(config, 5, "keep", 2, 64, 2)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen3_moe", "qwen3_5_text"])
def test_param_count_matches_modules(model_type):
    config = _tiny(model_type)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    for i, (layer, kind) in enumerate(zip(model.model.layers, layer_kinds(config))):
        real = sum(p.numel() for p in layer.parameters())
        assert layer_param_count(config, kind) == real, f"layer {i} ({kind})"
    cm = CostModel.from_config(config, "h800", 64, 1)
    assert cm.total_params == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO_MODELS)
def test_zoo_param_counts_match_real_models(name):
    zc = get_config(name)
    hf = as_hf_config(zc)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    cm = CostModel.from_config(zc, "h800", 1024, 1)
    assert cm.total_params == sum(p.numel() for p in model.parameters())


def test_zoo_sizes_are_the_published_ones():
    # Published parameter counts (model cards), text model only, within 2%.
    published = {"qwen2.5-7b": 7.61e9, "qwen2.5-32b": 32.76e9, "qwen3-8b": 8.19e9, "qwen3-30b-a3b": 30.5e9}
    for name, n in published.items():
        cm = CostModel.from_config(get_config(name), "h800", 1024, 1)
        assert abs(cm.total_params - n) / n < 0.02, (name, cm.total_params)


def test_flops_and_times_are_consistent():
    cm = CostModel.from_config(get_config("qwen3-8b"), "h800", 1024, 4)
    lc = cm.layers[0]
    # dense layer forward ~ 2 * N * params_matmul (+ attention); 6*N*P rule within 10%
    assert 2 * cm.tokens * lc.params < lc.flops_fwd < 1.1 * 2 * cm.tokens * lc.params + 4 * cm.tokens * 1024 * 4096
    hw = get_profile("h800")
    terms = layer_compute_terms(get_config("qwen3-8b"), lc.kind, 4, 1024)
    assert terms["gemm"] + terms["attention"] == pytest.approx(lc.flops_fwd)
    # the per-class terms: GEMMs at P * eta, the attention core at its own rates, memory passes at BW_mem, kernels
    gemm_s = terms["gemm"] / hw.rate("gemm")
    mem = terms["memory_fwd"] / hw.memory_bytes_per_s
    assert terms["memory_fwd"] == 2 * lc.saved_bytes
    assert terms["memory_bwd"] == 3 * lc.saved_bytes + 2 * lc.weight_bytes  # + the weight gradients written, read
    assert lc.fwd_s == pytest.approx(
        gemm_s + terms["attention"] / hw.rate("attention") + mem + terms["kernels"] * hw.kernel_overhead_s
    )
    assert lc.bwd_s == pytest.approx(
        2 * gemm_s
        + 2 * terms["attention"] / hw.rate("attention_bwd")
        + terms["memory_bwd"] / hw.memory_bytes_per_s
        + 2 * terms["kernels"] * hw.kernel_overhead_s
    )
    assert lc.flops_fwd / hw.flops_per_s < lc.fwd_s < 1.5 * lc.flops_fwd / hw.flops_per_s
    assert lc.optimizer_s == pytest.approx(lc.params / 8e9)
    cm8 = cm.with_batch(8)
    assert cm8.layers[0].saved_bytes == 2 * lc.saved_bytes  # linear in B at fixed T (sdpa)
    assert cm8.layers[0].weight_bytes == lc.weight_bytes


def test_with_measured_times_overrides_and_validates():
    cm = CostModel.from_config(get_config("qwen2.5-3b"), "rtx3090", 512, 1)
    L = cm.num_layers
    m = cm.with_measured_times([0.01] * L, [0.03] * L)
    assert all(lc.fwd_s == 0.01 and lc.bwd_s == 0.03 and lc.recompute_s == 0.01 for lc in m.layers)
    assert cm.layers[0].fwd_s != 0.01  # original untouched
    assert m.with_batch(2).layers[0].fwd_s == pytest.approx(0.02)  # measured times scale with tokens
    with pytest.raises(ValueError, match="3 fwd"):
        cm.with_measured_times([0.1] * 3, [0.1] * L)


def test_tied_embeddings_have_no_separate_head():
    tied = CostModel.from_config(get_config("qwen2.5-3b"), "h800", 1024, 1)
    untied = CostModel.from_config(get_config("qwen2.5-7b"), "h800", 1024, 1)
    assert tied.head_params == 0 and tied.embed_params == 151936 * 2048 + 2048
    assert untied.head_params == 152064 * 3584 + 3584


def test_layer_kinds_of_hybrid_zoo_model():
    kinds = layer_kinds(get_config("qwen3.6-27b"))
    assert kinds[:4] == ["linear_attention"] * 3 + ["full_attention"] and kinds.count("full_attention") == 16


def test_bad_inputs_raise():
    zc = get_config("qwen3-8b")
    with pytest.raises(ValueError, match="seq_len=0"):
        CostModel.from_config(zc, "h800", 0, 1)
    with pytest.raises(ValueError, match="micro_batch_size=-1"):
        CostModel.from_config(zc, "h800", 128, -1)
    with pytest.raises(ValueError, match="dtype_bytes=3"):
        CostModel.from_config(zc, "h800", 128, 1, dtype_bytes=3)
    with pytest.raises(ValueError, match="attn_implementation='flash'"):
        CostModel.from_config(zc, "h800", 128, 1, attn_implementation="flash")
    with pytest.raises(ValueError, match="not a bundled profile"):
        CostModel.from_config(zc, "tpu-v9", 128, 1)
