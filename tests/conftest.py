"""Shared fixtures: tiny Qwen models built from configs (never downloaded)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))

# Note: [Tests run under the simulated asynchronous engine]
# Every test runs with LAZYTRAIN_SIMULATE_ASYNC=1 (copies, reloads, NVMe I/O and overlapped optimizer updates land
# on worker threads after random delays; lazytrain_hf/streams.py), so a missing wait fails a test instead of passing
# on synchronous CPU copies. `LAZYTRAIN_SIMULATE_ASYNC=0 pytest ...` runs the suite on the synchronous engine instead;
# tests marked `sync_engine` (exact in-flight accounting of the synchronous path) always do.
# Profiles of the simulation (environment, passed through): `LAZYTRAIN_SIMULATE_AUTOGRAD_THREAD=1` runs every backward on
# a thread of its own, as CUDA's autograd device thread (Note: [Backward runs on another thread] in
# lazytrain_hf/threads.py); `LAZYTRAIN_SIMULATE_ASYNC_STALL_SHARE` / `_STALL_WORKERS` set how often, and which,
# background workers stall for longer than a forward (Note: [Every background worker stalls ...] in streams.py).
_SIMULATE = os.environ.get("LAZYTRAIN_SIMULATE_ASYNC", "1")


@pytest.fixture(autouse=True)
def _copy_engine(request, monkeypatch):
    sync = request.node.get_closest_marker("sync_engine") is not None
    monkeypatch.setenv("LAZYTRAIN_SIMULATE_ASYNC", "0" if sync else _SIMULATE)
    yield


@pytest.fixture
def async_engine(monkeypatch):
    """The simulated asynchronous CPU engine, whatever the environment says (the plan-space tests need it)."""
    monkeypatch.setenv("LAZYTRAIN_SIMULATE_ASYNC", "1")
    yield


TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_hidden_layers=4,
    vocab_size=128,
    max_position_embeddings=256,
    use_cache=False,
    # MoE / linear-attention families
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)


def tiny_config(model_type: str = "qwen3", **overrides):
    from transformers import AutoConfig

    kw = dict(TINY)
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def tiny_model(model_type: str = "qwen3", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(model_type, attn_implementation="eager", **overrides)
    return AutoModelForCausalLM.from_config(cfg)


def offload_step_device_bytes(num_layers: int = 8, inspect=None):
    """One forward + backward of a tiny qwen3 whose every layer offloads to the CPU: the activation engine's device
    bytes after each decoder layer's forward, and the largest per-layer CPU bytes. ``inspect(handle)`` runs while
    the executor is attached (checks of its settings)."""
    from lazytrain_hf import models
    from lazytrain_hf.planner.plan import LayerPlan, Plan
    from lazytrain_hf.streaming import attach

    model = tiny_model("qwen3", seed=1, num_hidden_layers=num_layers)
    kinds = models.layer_kinds(model.config)
    plan = Plan(
        layers=[LayerPlan(index=i, kind=k, policy="offload_cpu") for i, k in enumerate(kinds)],
        micro_batch_size=2,
        seq_len=10,
    )
    handle = attach(model, plan=plan)
    seen: list[int] = []
    hooks = [
        layer.register_forward_hook(lambda *_: seen.append(handle.activations.memory_stats()["gpu_bytes"]))
        for layer in models.decoder_layers(model)
    ]
    try:
        if inspect is not None:
            inspect(handle)
        ids = torch.randint(0, model.config.vocab_size, (2, 10))
        handle.causal_lm_loss(model, {"input_ids": ids, "labels": ids}).backward()
        per_layer = max(d["cpu"] for d in handle.activations.layer_bytes().values())
    finally:
        for h in hooks:
            h.remove()
        handle.remove()
    return model, seen, per_layer


RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "qwen_metamath.py")


def load_recipe():
    """The recipe module, loaded by path (recipes/ is not a package)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("qwen_metamath_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def evaluate_cache(tmp_path_factory):
    """evaluate copies the metric module under HF_HOME (paths read at import): use a temp dir for this run."""
    import evaluate.config as cfg

    home = tmp_path_factory.getbasetemp() / "hf_home"
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HOME", str(home))
    for name, sub in (
        ("HF_MODULES_CACHE", "modules"),
        ("HF_METRICS_CACHE", "metrics"),
        ("HF_EVALUATE_CACHE", "evaluate"),
    ):
        mp.setattr(cfg, name, home / sub)
    yield home
    mp.undo()


@pytest.fixture(autouse=True)
def _host_memory_rules():
    """Every test ends by raising the host-memory violations the registry recorded (a registered buffer freed while
    still registered: lazytrain_hf/pinned.py) and starts the next one clean."""
    from lazytrain_hf import pinned

    pinned.REGISTRY.check(reset=True)
    yield
    pinned.REGISTRY.check(reset=True)
