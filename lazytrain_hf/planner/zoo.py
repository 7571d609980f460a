"""Model zoo: configs of real Qwen models written from their public ``config.json`` facts, so plans for real sizes
need neither weights nor the network.

Only the fields the planner and the model table read are listed (sizes, heads, experts, layer types). `ZooConfig`
is a light attribute holder (no transformers import, so `lazytrain plan` starts fast); `as_hf_config()` turns it
into the real transformers config class when a model must be built (e.g. tiny tests, layer timing).
"""

from __future__ import annotations

import json
import os
from typing import Any


class ZooConfig:
    """Attribute view of a config dict, duck-typed like a transformers `PreTrainedConfig` for the planner."""

    def __init__(self, name: str, **fields: Any) -> None:
        self.name = name
        self.__dict__.update(fields)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "name"}

    def __repr__(self) -> str:
        return f"ZooConfig({self.name!r}, model_type={self.model_type!r}, layers={self.num_hidden_layers})"


def _hybrid_layer_types(n: int, interval: int = 4) -> list[str]:
    # Qwen3-Next / Qwen3.5 pattern: three linear-attention layers, then one full-attention layer, repeating.
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]


# Sources: the models' config.json on the Hugging Face Hub (Qwen/<name>); numbers copied, not derived.
_ZOO: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-3b": dict(
        model_type="qwen2",
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "qwen2.5-14b": dict(
        model_type="qwen2",
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "qwen2.5-32b": dict(
        model_type="qwen2",
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "qwen3-8b": dict(
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "qwen3-14b": dict(
        model_type="qwen3",
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "qwen3-32b": dict(
        model_type="qwen3",
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    # Qwen3.6-27B shares the Qwen3.5 text architecture (model_type qwen3_5_text for the text model): 64 layers,
    # 3 Gated-DeltaNet layers then 1 gated full-attention layer, repeating.
    "qwen3.6-27b": dict(
        model_type="qwen3_5_text",
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=_hybrid_layer_types(64),
        vocab_size=248320,
        tie_word_embeddings=False,
    ),
}

ZOO_MODELS: tuple[str, ...] = tuple(_ZOO)


def get_config(name: str) -> ZooConfig:
    """Zoo config by name (case-insensitive, ``Qwen/`` prefix allowed). Unknown names raise ValueError listing the
    zoo."""
    key = name.lower().removeprefix("qwen/")
    if key not in _ZOO:
        raise ValueError(
            f"model={name!r} is not in the model zoo; use one of {', '.join(ZOO_MODELS)} or a path to an HF "
            "config.json (or a directory holding one)."
        )
    fields = dict(_ZOO[key])
    if "layer_types" in fields:
        fields["layer_types"] = list(fields["layer_types"])
    return ZooConfig(key, **fields)


def load_config(name_or_path: str) -> Any:
    """A zoo name, or a path to an HF ``config.json`` / a directory with one (read with `AutoConfig`, offline).

    A multimodal Qwen3.5 config is reduced to its text config, which is what is trained here.
    """
    if os.path.isdir(name_or_path) or name_or_path.endswith(".json"):
        path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
        if not os.path.isfile(path):
            raise ValueError(f"model={name_or_path!r}: no config file at {path!r}.")
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"model={name_or_path!r}: {path} is not valid JSON ({e}).") from e
        if "text_config" in data and data.get("model_type") in ("qwen3_5", "qwen3_5_moe"):
            data = dict(data["text_config"], model_type=data["model_type"] + "_text")
        if "model_type" not in data:
            raise ValueError(f"model={name_or_path!r}: {path} has no 'model_type'; is it an HF config.json?")
        from transformers import AutoConfig  # lazy: only config classes, never Trainer

        model_type = data.pop("model_type")
        try:
            return AutoConfig.for_model(model_type, **data)
        except (ValueError, KeyError) as e:
            raise ValueError(
                f"model={name_or_path!r}: transformers cannot build model_type={model_type!r} ({e})."
            ) from e
    return get_config(name_or_path)


def as_hf_config(config: Any, **overrides: Any) -> Any:
    """The transformers config for ``config`` (a `ZooConfig` is converted; an HF config is copied with overrides)."""
    from transformers import AutoConfig

    data = config.to_dict()  # ZooConfig and HF configs alike
    data.update(overrides)
    model_type = data.pop("model_type")
    data.pop("transformers_version", None)
    return AutoConfig.for_model(model_type, **data)
