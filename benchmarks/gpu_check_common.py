"""Shared basics of ``gpu_check.py`` and its section modules: the log, the seed and parity tolerances, tiny HF
configs and the model sizes to measure, random-weight models and batches, device sync and memory release, the
wall-clock `Budget` and the guarded `run_section`.

The bottom of the gpu_check modules: ``gpu_check.py``, ``gpu_check_models.py``, ``gpu_check_plan_space.py`` and
``gpu_check_cuda.py`` import it (benchmarks/ is on ``sys.path`` when any of them runs), as do ``bench_cpu_plans.py``
and ``bench_cpu_predict.py``; it imports none of them.
"""

from __future__ import annotations

import gc
import statistics
import time
import traceback
from typing import Any

import torch

GiB = 2**30
# bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 2e-3 per operation); through a 4-layer model and its
# backward the relative L2 error of all gradients together against fp32 stays a few 1e-2 (single tensors can be far
# off in a MoE, where bf16 rounding flips which experts a token is routed to, so the check is on all gradients).
# Tensors whose fp32 norm is below PARITY_ATOL are compared absolutely.
PARITY_RTOL = 5e-2
PARITY_ATOL = 1e-6
SEED = 0


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------------- configs
def tiny_hf_config(model_type: str, hidden: int = 64, layers: int = 4, vocab: int = 512):
    from transformers import AutoConfig

    kw: dict[str, Any] = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        use_cache=False,
    )
    if model_type == "qwen3_moe":
        kw.update(moe_intermediate_size=hidden // 2, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
    return AutoConfig.for_model(model_type, **kw)


def model_configs(dry_run: bool, names: list[str]) -> list[tuple[str, Any]]:
    """``(name, HF config)`` per model size to measure."""
    if dry_run:
        return [(f"tiny-{t}", tiny_hf_config(t)) for t in ("qwen3", "qwen3_moe")]
    from lazytrain_hf.planner.zoo import as_hf_config, get_config

    return [(n, as_hf_config(get_config(n), use_cache=False)) for n in names]


# ---------------------------------------------------------------------------------------------------- models
def build_model(config: Any, dtype: torch.dtype, init_device: torch.device, seed: int = SEED) -> torch.nn.Module:
    """A causal LM of ``config`` on the CPU in ``dtype`` with random weights, built without the default init.

    Parameters are created on the meta device (buffers such as rotary frequencies are built normally), then
    materialised one at a time on the host: drawn on ``init_device`` (the GPU when there is one, which is far faster
    than the CPU for billions of values) and copied over. Values: N(0, initializer_range) for matrices, ones for norm
    weights, zeros for biases. Tied parameters stay one parameter.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    std = float(getattr(config, "initializer_range", 0.02))
    gen = torch.Generator(device=init_device).manual_seed(seed)
    done: dict[int, torch.nn.Parameter] = {}
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) in done:
                mod._parameters[pname] = done[id(p)]
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            data = torch.empty(p.shape, dtype=dtype, device="cpu")
            if p.dim() == 1 and "norm" in full:
                data.fill_(1.0)
            elif p.dim() == 1:
                data.zero_()
            else:
                data.copy_(torch.randn(p.shape, generator=gen, device=init_device, dtype=torch.float32).mul_(std))
            new = torch.nn.Parameter(data, requires_grad=p.requires_grad)
            done[id(p)] = new
            mod._parameters[pname] = new
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # the model built under init_empty_weights is not tied yet
    model.train()
    return model


def make_batch(vocab: int, batch: int, seq: int, device: torch.device, seed: int = 1) -> dict[str, torch.Tensor]:
    """Full-length random sequences (no padding); the attention mask is passed so tokens are counted from it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones_like(ids).to(device),
        "labels": ids.clone().to(device),
    }


def count_params(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    n = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    # Only the CUDA caching allocator holds memory for dropped models; on the CPU a full collection (~0.2 s with
    # transformers imported) buys nothing.
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- guard
class Budget:
    """Global wall-clock budget: callers ask before starting work they can skip."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.t0 = time.perf_counter()
        self.slowdowns: list[float] = []  # measured / simulated step time of every run so far

    def run_estimate(self, sim_step_s: float, steps: int, setup_s: float) -> float:
        """Seconds a run of ``steps`` steps is expected to take, from the simulated step time corrected by how far
        measured runs have been from their simulation so far."""
        slow = statistics.median(self.slowdowns) if self.slowdowns else 1.0
        return 1.5 * steps * slow * sim_step_s + setup_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def allows(self, estimate_s: float = 0.0) -> bool:
        return self.elapsed() + estimate_s <= self.seconds


def run_section(report: dict, name: str, fn, *args, **kwargs) -> Any:
    """Run one section; record ok/error (with traceback) and its seconds in ``report["sections"][name]``."""
    log(f"\n== {name}")
    t0 = time.perf_counter()
    entry: dict[str, Any] = {"status": "ok"}
    result = None
    try:
        result = fn(*args, **kwargs)
        entry["result"] = result
    except Exception as e:  # recorded; the remaining sections still run
        entry.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        log(f"   section {name} failed: {type(e).__name__}: {e}")
    entry["seconds"] = round(time.perf_counter() - t0, 3)
    report["sections"][name] = entry
    return result
