"""Chunked causal-LM loss against transformers' ForCausalLMLoss: value, gradients, semantics, memory.

Tolerances: the chunked loss sums per-chunk fp32 sums and accumulates the lm_head gradient chunk by chunk (and
computes d logits as softmax - onehot instead of through log_softmax's backward), so fp32 rounding differs from
the one-shot reference: rtol=1e-5 on the loss, rtol=1e-4 / atol=1e-6 on gradients.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from test_streaming import padded_batch
from transformers.loss.loss_utils import ForCausalLMLoss

from lazytrain_hf.streaming import attach, chunked_causal_lm_loss


def _inputs(B=2, T=9, D=16, V=40, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g, requires_grad=True)
    w = (torch.randn(V, D, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).requires_grad_() if bias else None
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, :3] = -100
    y[1, -2:] = -100
    return h, w, b, y


def _grads(*ts):
    out = [t.grad.clone() if t is not None else None for t in ts]
    for t in ts:
        if t is not None:
            t.grad = None
    return out


@pytest.mark.parametrize("chunk", [1, 4, 7, 18, 1000])
@pytest.mark.parametrize("num_items", [None, 11, "tensor"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_hf_loss(chunk, num_items, bias):
    h, w, b, y = _inputs(bias=bias)
    n = torch.tensor(11) if num_items == "tensor" else num_items
    ref = ForCausalLMLoss(F.linear(h, w, b), y, w.shape[0], num_items_in_batch=n)
    ref.backward()
    ref_g = _grads(h, w, b)
    loss = chunked_causal_lm_loss(h, w, y, chunk_tokens=chunk, num_items_in_batch=n, lm_head_bias=b)
    (loss * 3.0).backward()  # a non-unit grad_output is applied in backward
    got = _grads(h, w, b)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    for r, g in zip(ref_g, got):
        if r is not None:
            torch.testing.assert_close(g, 3.0 * r, rtol=1e-4, atol=1e-6)


def test_single_chunk_loss_bit_exact():
    """With one chunk and reduction sum, the value is the same kernel sequence as HF: bit-exact."""
    h, w, _, y = _inputs()
    ref = ForCausalLMLoss(F.linear(h, w), y, w.shape[0], num_items_in_batch=1)
    assert torch.equal(chunked_causal_lm_loss(h, w, y, chunk_tokens=10_000, num_items_in_batch=1), ref)


def test_ignore_index_and_frozen_inputs():
    h, w, _, y = _inputs()
    y2 = y.clone()
    y2[y2 == -100] = 7
    y2[:, 4] = 7
    ref = ForCausalLMLoss(F.linear(h, w), y2, w.shape[0], ignore_index=7)
    got = chunked_causal_lm_loss(h, w, y2, chunk_tokens=5, ignore_index=7)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=0)
    # no gradient wanted for w: only h gets one
    w.requires_grad_(False)
    chunked_causal_lm_loss(h, w, y, chunk_tokens=5).backward()
    assert h.grad is not None and w.grad is None


def test_bf16_matches_hf_loss():
    """bf16 logits upcast to fp32 as in HF; bf16 gradients. Tolerance 2e-2 relative: one bf16 rounding of d logits
    and of the chunked matmul sums (HF sums the weight gradient in one bf16 matmul, this one rounds the running sum
    to bf16 once per chunk: Note: [The lm_head gradient is accumulated in the weight's dtype])."""
    h, w, _, y = _inputs(D=32, V=64)
    hb = h.detach().bfloat16().requires_grad_()
    wb = w.detach().bfloat16().requires_grad_()
    ref = ForCausalLMLoss(F.linear(hb, wb), y, 64)
    ref.backward()
    rh, rw = _grads(hb, wb)
    got = chunked_causal_lm_loss(hb, wb, y, chunk_tokens=4)
    got.backward()
    assert got.dtype == torch.float32 and hb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=0)
    torch.testing.assert_close(hb.grad.float(), rh.float(), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(wb.grad.float(), rw.float(), rtol=2e-2, atol=2e-3)


def _chunk_logit_grads(h, w, y, chunk):
    """The per-chunk d logits the loss computes (same ops), in the weight's dtype: what its weight GEMMs read."""
    target = F.pad(y, (0, 1), value=-100)[..., 1:].reshape(-1)
    hf = h.detach().reshape(-1, h.shape[-1])
    valid = target != -100
    scale = 1.0 / valid.sum().float()
    out = []
    for s in range(0, hf.shape[0], chunk):
        yc, vc = target[s : s + chunk], valid[s : s + chunk]
        g = torch.log_softmax(F.linear(hf[s : s + chunk], w.detach()).float(), dim=-1).exp_()
        idx = torch.where(vc, yc, torch.zeros_like(yc)).unsqueeze(1)
        g.scatter_add_(1, idx, torch.full_like(idx, -1, dtype=g.dtype))
        g.mul_((vc.to(g.dtype) * scale).unsqueeze(1))
        out.append((g.to(w.dtype), hf[s : s + chunk]))
    return out


def test_bf16_lm_head_grad_bound():
    """The bf16 lm_head gradient is accumulated in bf16, one rounding of the running sum per chunk (Note: [The
    lm_head gradient is accumulated in the weight's dtype]). Against the exact (fp64) sum of the same per-chunk
    products it stays within the stated bound ``C * 2^-8 * max_k |S_k|`` elementwise (plus the fp32 summation inside
    each GEMM, ``n * 2^-23 * sum |g||h|``), and against the fp32 model's gradient within 2e-2 relative (Frobenius),
    the same order as bf16 rounding of d logits itself. Measured here (C = 16 chunks): 4.5e-3 vs the exact sum and
    6.1e-3 vs fp32 (an fp32 accumulator rounded once: 1.7e-3 and 4.4e-3; 128 chunks of one token: 6.5e-3 and
    7.7e-3)."""
    B, T, D, V, chunk = 2, 64, 64, 256, 8
    h, w, _, y = _inputs(B=B, T=T, D=D, V=V, seed=3)
    hb = h.detach().bfloat16().requires_grad_()
    wb = w.detach().bfloat16().requires_grad_()
    chunked_causal_lm_loss(hb, wb, y, chunk_tokens=chunk).backward()
    got = wb.grad.double()
    parts = _chunk_logit_grads(hb, wb, y, chunk)
    C = len(parts)
    assert C == B * T // chunk == 16
    partial = torch.zeros(V, D, dtype=torch.float64)
    max_partial = torch.zeros(V, D, dtype=torch.float64)
    gemm_abs = torch.zeros(V, D, dtype=torch.float64)
    for g, hc in parts:
        partial += g.double().t() @ hc.double()
        max_partial = torch.maximum(max_partial, partial.abs())
        gemm_abs += g.double().abs().t() @ hc.double().abs()
    exact = partial
    bound = C * 2.0**-8 * max_partial + chunk * 2.0**-23 * gemm_abs
    err = (got - exact).abs()
    worst = (err / bound.clamp_min(1e-30)).max().item()
    assert worst <= 1.0, f"bf16 lm_head gradient outside the bound: max err/bound {worst:.3f}"
    rel_exact = ((got - exact).norm() / exact.norm()).item()
    # the fp32 model's gradient (fp32 logits, fp32 GEMMs)
    hf32, wf32 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    chunked_causal_lm_loss(hf32, wf32, y, chunk_tokens=chunk).backward()
    ref = wf32.grad.double()
    rel_fp32 = ((got - ref).norm() / ref.norm()).item()
    assert rel_exact < 1e-2 and rel_fp32 < 2e-2, (rel_exact, rel_fp32)
    assert wb.grad.dtype == torch.bfloat16


class _BigFp32Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every fp32 tensor of at least ``numel`` elements an op produces."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel = numel
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= self.numel:
                self.seen.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_no_fp32_vocab_buffer_in_bf16(dtype):
    """bf16: no fp32 ``V x D`` tensor is allocated in the loss's forward or backward, and the bytes held from the
    forward to the backward are the hidden gradient plus the weight gradient in bf16 (``(N + V) * D * 2``; the fp32
    accumulator held ``V * D * 4`` for the weight). fp32: the same detector sees the fp32 weight gradient (so it
    would see an fp32 buffer in bf16 too), and the fp32 path is unchanged."""
    B, T, D, V = 2, 16, 32, 512
    h, w, _, y = _inputs(B=B, T=T, D=D, V=V, seed=2)
    h = h.detach().to(dtype).requires_grad_()
    w = w.detach().to(dtype).requires_grad_()
    stats: dict[str, int] = {}
    with _BigFp32Allocations(V * D) as mode:
        loss = chunked_causal_lm_loss(h, w, y, chunk_tokens=4, stats=stats)
        held = [t for t in loss.grad_fn.grads if t is not None]  # what the autograd node keeps until backward
        held_bytes = sum(t.numel() * t.element_size() for t in held)
        loss.backward()
    N, item = B * T, dtype.itemsize
    assert held_bytes == stats["grad_bytes"] == (N + V) * D * item
    assert {t.dtype for t in held} == {dtype}
    if dtype == torch.bfloat16:
        assert not mode.seen, f"fp32 vocabulary-sized tensors allocated: {mode.seen[:5]}"
    else:
        assert any(shape == (V, D) for _, shape in mode.seen), mode.seen
    assert w.grad.dtype == dtype and w.grad.shape == (V, D)


def test_errors():
    h, w, _, y = _inputs()
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        chunked_causal_lm_loss(h, w, y, chunk_tokens=0)
    with pytest.raises(ValueError, match="chunk_tokens=True"):
        chunked_causal_lm_loss(h, w, y, chunk_tokens=True)
    with pytest.raises(ValueError, match="labels must have shape"):
        chunked_causal_lm_loss(h, w, y[:, :3])
    with pytest.raises(ValueError, match="hidden_states must be"):
        chunked_causal_lm_loss(h[0], w, y)
    with pytest.raises(ValueError, match="hidden size"):
        chunked_causal_lm_loss(h, w[:, :3], y)
    with pytest.raises(ValueError, match="dtype"):
        chunked_causal_lm_loss(h, w.double(), y)
    with pytest.raises(TypeError, match="num_items_in_batch"):
        chunked_causal_lm_loss(h, w, y, num_items_in_batch="3")


# ------------------------------------------------------------------------------------------ through the executor
@pytest.mark.parametrize("tied", [False, True])
def test_handle_causal_lm_loss_matches_model_loss(tied):
    batch = padded_batch(batch=2, seq=12)
    ref = tiny_model("qwen3", tie_word_embeddings=tied)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    ref_g = {n: p.grad.clone() for n, p in ref.named_parameters()}

    model = tiny_model("qwen3", tie_word_embeddings=tied)
    handle = attach(model)
    handle.plan.loss_chunk_tokens = 5
    loss = handle.causal_lm_loss(model, batch)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    got = handle.grads()
    assert sorted(got) == sorted(ref_g)
    for n, g in ref_g.items():
        torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    st = handle.memory_stats()
    V = model.config.vocab_size
    # fp32 model: one chunk's logits and their log-probabilities (reused in place as d logits) at most
    assert 0 < st["loss_chunk_peak_bytes"] <= 2 * 5 * V * 4 + 2 * 12 * 32 * 4 + V * 32 * 4
    assert handle._loss_stats["chunk_peak_bytes"] == 2 * 5 * V * 4
    assert handle._loss_stats["chunks"] == 5  # 24 tokens in chunks of 5
    handle.remove()


def test_handle_causal_lm_loss_num_items():
    batch = padded_batch(batch=2, seq=12)
    ref = tiny_model("qwen3")
    ref_loss = ref(**batch, num_items_in_batch=50).loss
    model = tiny_model("qwen3")
    handle = attach(model)
    loss = handle.causal_lm_loss(model, batch, num_items_in_batch=50)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    handle.remove()


# ------------------------------------------------------------------------------------------ memory, measured
def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _peak_rss_growth(fn) -> int:
    """Peak resident-set growth while ``fn`` runs (Linux: VmHWM reset through /proc/self/clear_refs)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_bytes("VmRSS:")
    fn()
    return _status_bytes("VmHWM:") - base


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc peak-RSS reset")
def test_logits_term_is_one_chunk_measured():
    """Measured process memory: the full B x T x V logits (128 MiB here) never exist with the chunked loss, while
    the plain loss needs several copies of them. Chunk working set: 2 x 256 x 8192 x 4 B = 16 MiB."""
    B, T, D, V = 2, 2048, 64, 8192
    full = B * T * V * 4
    h, w, _, y = _inputs(B=B, T=T, D=D, V=V, seed=1)

    def chunked():
        chunked_causal_lm_loss(h, w, y, chunk_tokens=256).backward()

    def plain():
        ForCausalLMLoss(F.linear(h, w), y, V).backward()

    chunked()  # warm the allocator so the measured run allocates what it needs, not first-touch overheads
    _grads(h, w)
    grow_chunked = _peak_rss_growth(chunked)
    _grads(h, w)
    grow_plain = _peak_rss_growth(plain)
    _grads(h, w)
    assert grow_plain > full, (grow_plain, full)  # the measurement sees the full logits when they exist
    assert grow_chunked < full / 2, (grow_chunked, full)
    stats: dict[str, int] = {}
    chunked_causal_lm_loss(h, w, y, chunk_tokens=256, stats=stats)
    assert stats["full_logits_bytes"] == full and stats["chunk_peak_bytes"] == 2 * 256 * V * 4
