"""Architecture facts of the supported model families, in ONE table keyed by ``config.model_type``.

Every other module asks this table where things live (decoder layers, embeddings, final norm, lm_head, rotary
module) and what kind each layer is; nothing else probes model classes with ``hasattr``.

Layer kinds are strings ``"<attention>"`` or ``"<attention>+moe"`` with ``<attention>`` in
``{"full_attention", "linear_attention"}``: the planner's cost model and the executor's slot pool size layers by kind
(hybrid and MoE layers differ in size).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

ATTENTION_KINDS = ("full_attention", "linear_attention")


def _sparse_by_step(config: Any, i: int) -> bool:
    """MoE block at layer i, as `Qwen2MoeDecoderLayer` / `Qwen3MoeDecoderLayer` / `Qwen3NextDecoderLayer` decide it."""
    mlp_only = set(getattr(config, "mlp_only_layers", None) or [])
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return i not in mlp_only and num_experts > 0 and (i + 1) % step == 0


def _always_moe(config: Any, i: int) -> bool:
    return True


def _never_moe(config: Any, i: int) -> bool:
    return False


@dataclass(frozen=True)
class ModelSpec:
    """Where a family keeps its modules (dotted paths from the `*ForCausalLM` root) and how layers are typed."""

    model_type: str
    is_moe: Callable[[Any, int], bool]
    # the transformers class the executor streams (its lm_head computes the loss); subclasses of it are accepted
    causal_lm_class: str = ""
    layers: str = "model.layers"
    embed_tokens: str = "model.embed_tokens"
    norm: str = "model.norm"
    lm_head: str = "lm_head"
    rotary_emb: str = "model.rotary_emb"
    # expert weights are fused 3-D parameters (`experts.gate_up_proj`), not a ModuleList
    fused_experts: bool = True
    has_linear_attention: bool = False
    # MoE blocks with a shared expert (+ sigmoid gate) beside the routed ones
    has_shared_expert: bool = False
    # the `*ForCausalLM` adds `router_aux_loss_coef * load_balancing_loss_func(...)` when output_router_logits is on
    router_aux_loss: bool = False


MODEL_TABLE: dict[str, ModelSpec] = {
    "qwen2": ModelSpec("qwen2", _never_moe, "Qwen2ForCausalLM"),
    "qwen2_moe": ModelSpec(
        "qwen2_moe", _sparse_by_step, "Qwen2MoeForCausalLM", has_shared_expert=True, router_aux_loss=True
    ),
    "qwen3": ModelSpec("qwen3", _never_moe, "Qwen3ForCausalLM"),
    "qwen3_moe": ModelSpec("qwen3_moe", _sparse_by_step, "Qwen3MoeForCausalLM", router_aux_loss=True),
    "qwen3_next": ModelSpec(
        "qwen3_next",
        _sparse_by_step,
        "Qwen3NextForCausalLM",
        has_linear_attention=True,
        has_shared_expert=True,
        router_aux_loss=True,
    ),
    "qwen3_5_text": ModelSpec("qwen3_5_text", _never_moe, "Qwen3_5ForCausalLM", has_linear_attention=True),
    "qwen3_5_moe_text": ModelSpec(
        "qwen3_5_moe_text",
        _always_moe,
        "Qwen3_5MoeForCausalLM",
        has_linear_attention=True,
        has_shared_expert=True,
        router_aux_loss=True,
    ),
}


def supported_model_types() -> list[str]:
    return sorted(MODEL_TABLE)


def get_spec(config_or_model: Any) -> ModelSpec:
    """The `ModelSpec` of a config or model. Unsupported types raise ValueError listing the supported ones."""
    config = getattr(config_or_model, "config", config_or_model)
    model_type = getattr(config, "model_type", None)
    spec = MODEL_TABLE.get(model_type)
    if spec is None:
        hint = ""
        if model_type in ("qwen3_5", "qwen3_5_moe"):
            hint = f" For the multimodal {model_type} checkpoint, load its text model ({model_type}_text)."
        raise ValueError(
            f"model_type={model_type!r} is not supported by lazytrain_hf; supported model types are "
            f"{', '.join(supported_model_types())}.{hint}"
        )
    return spec


def supported_model_classes() -> list[str]:
    return [MODEL_TABLE[t].causal_lm_class for t in supported_model_types()]


def check_causal_lm(model: nn.Module) -> ModelSpec:
    """The `ModelSpec` of ``model`` (the `*ForCausalLM`, not a PEFT wrapper), refusing a supported family with
    another head (``Qwen3ForSequenceClassification``, ``...ForTokenClassification``, a bare ``Qwen3Model``): the
    executor streams the decoder layers of a causal LM and computes its loss from the lm_head."""
    spec = get_spec(model)
    names = {c.__name__ for c in type(model).__mro__}
    if spec.causal_lm_class not in names:
        raise ValueError(
            f"{type(model).__name__} (model_type={spec.model_type!r}) is not supported by lazytrain_hf's streaming "
            f"path, which trains causal language models: {', '.join(supported_model_classes())} (or subclasses). "
            f"Load the model with AutoModelForCausalLM, or train {type(model).__name__} with stream_enabled=False "
            "(plain Trainer)."
        )
    return spec


def attention_kinds(config: Any) -> list[str]:
    n = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return ["full_attention"] * n
    kinds = []
    for i, t in enumerate(layer_types[:n]):
        # qwen2/qwen3 use "sliding_attention" for windowed layers: same cost class as full attention here.
        kinds.append("linear_attention" if t == "linear_attention" else "full_attention")
        if t not in ("full_attention", "linear_attention", "sliding_attention"):
            raise ValueError(
                f"config.layer_types[{i}]={t!r} is not supported; expected full/sliding/linear attention."
            )
    return kinds


def layer_kinds(config: Any) -> list[str]:
    """Kind of every decoder layer, e.g. ``["linear_attention+moe", ..., "full_attention+moe"]``."""
    config = getattr(config, "config", config)
    spec = get_spec(config)
    return [a + ("+moe" if spec.is_moe(config, i) else "") for i, a in enumerate(attention_kinds(config))]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.get_submodule(get_spec(model).layers)


def embed_tokens(model: nn.Module) -> nn.Module:
    return model.get_submodule(get_spec(model).embed_tokens)


def final_norm(model: nn.Module) -> nn.Module:
    return model.get_submodule(get_spec(model).norm)


def lm_head(model: nn.Module) -> nn.Module:
    return model.get_submodule(get_spec(model).lm_head)


def rotary_emb(model: nn.Module) -> nn.Module:
    return model.get_submodule(get_spec(model).rotary_emb)


def router_aux_loss(model: nn.Module, router_logits: Any, attention_mask: Any, coef: float | None = None) -> Any:
    """``router_aux_loss_coef * load_balancing_loss_func(...)`` exactly as the family's ``*ForCausalLM.forward`` adds
    it to the loss (the function of the model class's own module, with its ``num_experts`` and
    ``num_experts_per_tok``). ``coef``: another weight than the model's ``router_aux_loss_coef`` (TRL's SFT divides
    it by the gradient-accumulation steps)."""
    import sys

    fn = sys.modules[type(model).__module__].load_balancing_loss_func
    aux = fn(router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)
    return (model.router_aux_loss_coef if coef is None else coef) * aux


def ties_embeddings(model_or_config: Any) -> bool:
    """True when lm_head shares its weight with the input embedding."""
    config = getattr(model_or_config, "config", model_or_config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if isinstance(model_or_config, nn.Module) and tied:
        return lm_head(model_or_config).weight is embed_tokens(model_or_config).weight
    return tied
