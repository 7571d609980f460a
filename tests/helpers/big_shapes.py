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

# a 128-layer MoE: the Qwen3-235B shape above, deeper
MOE_128L = ZooConfig("qwen3-moe-128l", **{**QWEN3_235B.to_dict(), "num_hidden_layers": 128})

# Qwen2.5-72B's architecture (its public config.json): 80 dense layers
QWEN25_72B = ZooConfig(
    "qwen2.5-72b",
    **{
        **get_config("qwen2.5-32b").to_dict(),  # the same Qwen2.5 family: norms, vocabulary, biases
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
)
