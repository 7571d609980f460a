from __future__ import annotations

import pytest
from conftest import tiny_config, tiny_model

from lazytrain_hf import models

FAMILIES = ["qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_table_paths_resolve_on_real_models(model_type):
    model = tiny_model(model_type)
    layers = models.decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    assert models.embed_tokens(model).weight.shape[0] == model.config.vocab_size
    assert models.lm_head(model).weight.shape[0] == model.config.vocab_size
    assert models.final_norm(model).weight.shape[0] == model.config.hidden_size
    assert models.rotary_emb(model) is not None
    kinds = models.layer_kinds(model)
    assert len(kinds) == len(layers)
    # every layer kind agrees with the module actually built
    for layer, kind in zip(layers, kinds):
        assert ("linear_attn" in dict(layer.named_children())) == kind.startswith("linear_attention")
        is_moe = "experts" in dict(layer.mlp.named_children())
        assert is_moe == kind.endswith("+moe"), (model_type, kind, type(layer.mlp).__name__)


def test_mlp_only_layers_and_sparse_step():
    cfg = tiny_config("qwen3_moe", mlp_only_layers=[1], decoder_sparse_step=1)
    assert models.layer_kinds(cfg) == ["full_attention+moe", "full_attention", "full_attention+moe", "full_attention+moe"]
    cfg = tiny_config("qwen2_moe", decoder_sparse_step=2)
    assert models.layer_kinds(cfg) == ["full_attention", "full_attention+moe"] * 2


def test_hybrid_layer_kinds():
    kinds = models.layer_kinds(tiny_config("qwen3_5_text", num_hidden_layers=8))
    assert kinds == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]


def test_tied_embeddings():
    model = tiny_model("qwen3", tie_word_embeddings=True)
    assert models.ties_embeddings(model)
    assert not models.ties_embeddings(tiny_model("qwen3", tie_word_embeddings=False))


def test_unsupported_model_type_lists_supported():
    from transformers import AutoConfig

    with pytest.raises(ValueError) as e:
        models.get_spec(AutoConfig.for_model("llama"))
    msg = str(e.value)
    assert "'llama'" in msg
    for t in models.supported_model_types():
        assert t in msg


def test_unsupported_layer_type_is_named():
    cfg = tiny_config("qwen3")
    cfg.layer_types = ["full_attention", "chunked_attention", "full_attention", "full_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        models.layer_kinds(cfg)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text"])
def test_shared_expert_flag_matches_modules(model_type):
    model = tiny_model(model_type)
    moe = [layer.mlp for layer in models.decoder_layers(model) if "experts" in dict(layer.mlp.named_children())]
    assert moe
    assert all(("shared_expert" in dict(m.named_children())) == models.get_spec(model).has_shared_expert for m in moe)
