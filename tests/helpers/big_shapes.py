"""Large model shapes the solver tests plan for (planner only: nothing is built)."""

from lazytrain_hf.planner.zoo import ZooConfig, get_config

# Qwen3-235B-A22B's architecture (its public config.json): 94 MoE layers, 128 experts, 8 per token
QWEN3_235B = ZooConfig(
    "qwen3-235b-a22b",
    **{
        **get_config("qwen3-30b-a3b").to_dict(),  # the same Qwen3-MoE family: experts, norms, vocabulary
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
    },
)
