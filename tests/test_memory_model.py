"""The memory model against the CPU allocator's own counts (`helpers.memtrace.AllocationTrace`).

- The chunked loss: the allocator's peak over its forward and backward equals the executor's accounting
  (``stats["peak_bytes"]``) and the formula ``8 x chunk x V + N x d x db + V x d x db`` (the fp32 logits of one chunk
  and their log-probabilities, the hidden-state gradient, the lm_head gradient), at two shapes, fp32 and bf16; the
  cost model's ``head_ws_bytes + head_grad_bytes`` is above it (what it over-counts is printed).
- Every layer kind (dense, MoE, gated delta rule and gated attention of qwen3.5, qwen2's biased attention, eager
  attention) at two batch sizes: the allocator's peak increment over a layer's forward and over its backward
  (beyond what was live when it began) against the stage model's charge for the same phase (forward:
  ``saved + ws_fwd - x``; backward: ``ws_bwd + grad``, the saved tensors being held already) and against the
  megatrain model's backward charge (``ws_bwd - 3 N I db + grad``, Note: [MegaTrain's backward working set] in
  baselines.py). Both models are upper bounds of the measurement; the measured backward increment is below even
  megatrain's single gate/up-sized gradient, so of the two the megatrain term is the right one (4 x N x I is not).
"""

from __future__ import annotations

import pytest
import torch
from helpers.memtrace import AllocationTrace

from lazytrain_hf.planner.costmodel import CostModel
from lazytrain_hf.planner.hardware import get_profile
from lazytrain_hf.streaming.loss import chunked_causal_lm_loss

transformers = pytest.importorskip("transformers")
MIB = 2**20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,V,d,chunk", [(2, 256, 16384, 768, 1024), (4, 128, 8192, 256, 256)])
def test_chunked_loss_working_set_is_measured(dtype, B, T, V, d, chunk):
    torch.manual_seed(0)
    db = torch.tensor([], dtype=dtype).element_size()
    h = torch.randn(B, T, d, dtype=dtype, requires_grad=True)
    w = torch.randn(V, d, dtype=dtype, requires_grad=True)
    y = torch.randint(0, V, (B, T))
    stats: dict[str, int] = {}
    with AllocationTrace() as tr:
        loss = chunked_causal_lm_loss(h, w, y, chunk_tokens=chunk, stats=stats)
        loss.backward()
    N, C = B * T, min(chunk, B * T)
    formula = 8 * C * V + N * d * db + V * d * db
    # the allocator's count: the shifted int64 targets, the validity mask and scalars beside the formula's terms
    assert formula <= tr.peak <= formula + 16 * N + 1024, (tr.peak, formula)
    assert stats["peak_bytes"] == formula  # the executor's own accounting is the allocator's
    cfg = transformers.AutoConfig.for_model(
        "qwen3", hidden_size=d, vocab_size=V, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, intermediate_size=4 * d, tie_word_embeddings=False,
    )  # fmt: skip
    cm = CostModel.from_config(cfg, get_profile("h800"), T, B, dtype_bytes=db, loss_chunk_tokens=chunk)
    modelled = cm.head_ws_bytes + cm.head_grad_bytes
    print(f"chunked loss {dtype} N={N} V={V}: measured {tr.peak / MIB:.2f} MiB, modelled {modelled / MIB:.2f} MiB")
    assert modelled >= tr.peak


def _tiny(model_type: str, attn: str):
    base = dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=512,
        use_cache=False,
    )
    if model_type == "qwen3_moe":
        base.update(moe_intermediate_size=192, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    if model_type == "qwen3_5_text":
        base.update(
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
        )
    if model_type == "qwen2":
        base.pop("head_dim")
    cfg = transformers.AutoConfig.for_model(model_type, **base)
    cfg._attn_implementation = attn
    return cfg


def measure_layer(layer, rotary, B: int, T: int, d: int, dtype: torch.dtype) -> tuple[int, int]:
    """Allocator peak increments (bytes) over one decoder layer's forward and over its backward."""
    x = torch.randn(B, T, d, dtype=dtype, requires_grad=True)
    pos = torch.arange(T).unsqueeze(0).expand(B, T)
    pe = rotary(x, pos)
    with AllocationTrace() as fwd:
        out = layer(x, position_embeddings=pe, attention_mask=None, position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
    g = torch.randn_like(out)
    with AllocationTrace() as bwd:
        out.backward(g)
    return fwd.peak, bwd.peak


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type,attn,dtype",
    [
        ("qwen3", "sdpa", torch.float32),
        ("qwen3", "eager", torch.bfloat16),
        ("qwen3_moe", "sdpa", torch.float32),
        ("qwen3_5_text", "sdpa", torch.bfloat16),
        ("qwen2", "sdpa", torch.bfloat16),
    ],
)
def test_layer_working_sets_are_bounded_by_the_models(model_type, attn, dtype):
    cfg = _tiny(model_type, attn)
    db = torch.tensor([], dtype=dtype).element_size()
    T = 128
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).train()
    rows = []
    for B in (1, 4):
        cm = CostModel.from_config(cfg, get_profile("h800"), T, B, dtype_bytes=db, attn_implementation=attn)
        N, d = B * T, cfg.hidden_size
        x = N * d * db
        seen = set()
        for i, layer in enumerate(model.model.layers):
            lc = cm.layers[i]
            if lc.kind in seen:
                continue
            seen.add(lc.kind)
            f_peak, b_peak = measure_layer(layer, model.model.rotary_emb, B, T, d, dtype)
            moe = "+moe" in lc.kind
            inner = cfg.moe_intermediate_size * cfg.num_experts_per_tok if moe else cfg.intermediate_size
            f_model = lc.saved_bytes + lc.ws_fwd_bytes - x  # the input was live before the forward began
            b_model = lc.ws_bwd_bytes + lc.grad_bytes - x  # the incoming gradient was live before the backward
            b_megatrain = b_model - 3 * N * inner * db
            rows.append((lc.kind, B, f_peak, f_model, b_peak, b_model, b_megatrain))
    for kind, B, f_peak, f_model, b_peak, b_model, b_mt in rows:
        print(
            f"{model_type} {attn} {dtype} {kind} B={B}: forward measured {f_peak / MIB:.3f} MiB, stage model "
            f"{f_model / MIB:.3f}; backward measured {b_peak / MIB:.3f} MiB, stage model {b_model / MIB:.3f}, "
            f"megatrain model {b_mt / MIB:.3f}"
        )
        assert f_model >= 0.95 * f_peak, (kind, B, f_peak, f_model)  # within 5% or above
        assert b_mt >= b_peak, (kind, B, b_peak, b_mt)  # one gate/up-sized gradient is enough (not four)
