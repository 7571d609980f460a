"""Chunked causal-LM loss: lm_head + cross entropy over sequence chunks, each chunk's backward done in forward.

The loss of a causal LM needs ``B x T x V`` logits (fp32 upcast in HF: 4 bytes x 151k vocabulary x tokens, often
more than all the activations of a layer). `chunked_causal_lm_loss` computes, for one chunk of ``chunk_tokens``
tokens at a time, the logits, the chunk's summed cross entropy and immediately its gradient with respect to the
hidden states and the lm_head weight; the logits are then dropped. Only one chunk's logits ever exist, and no
chunk keeps an autograd graph (a known defect of chunked losses that just split the forward). Backward only
scales the stored gradients by ``grad_output``.

Semantics are those of transformers' ``ForCausalLMLoss``: labels are shifted left inside (the last position gets
``ignore_index``), logits are upcast to fp32, reduction is ``sum / num_items_in_batch`` when ``num_items_in_batch``
is given, else the mean over non-ignored tokens.

Note: [The lm_head gradient is accumulated in the weight's dtype]
    The weight gradient ``sum_chunks g_c^T h_c`` is accumulated, chunk by chunk, in one ``V x D`` buffer of the
    weight's dtype, by ``grad_w.addmm_(g_c^T, h_c)`` with ``g_c`` already in that dtype (the same tensor the hidden
    gradient uses). For fp32 weights nothing changes: fp32 GEMMs into an fp32 buffer. For bf16 (or fp16) weights
    each chunk is one GEMM of the compute dtype, whose products are summed in fp32 inside the kernel (tensor cores
    on CUDA, oneDNN on the CPU), and the running sum is rounded to the weight's dtype once per chunk: with ``C``
    chunks and unit roundoff ``u`` (``2^-8`` for bf16), ``|grad_w - exact| <= C * u * max_k |S_k|`` elementwise,
    ``S_k`` the partial sums (typically ``sqrt(C) * u / 2`` relative, since roundings are unbiased); one chunk is
    exactly the single GEMM autograd runs for a bf16 model. No fp32 ``V x D`` buffer (4 B x 152k x d at Qwen's
    vocabulary) exists at any time, and the buffer held from the loss forward to its backward is the size of the
    gradient itself, which backward hands to autograd (it becomes ``weight.grad`` on the first micro-batch).
    Tests: ``tests/test_chunked_loss.py::test_bf16_lm_head_grad_bound`` (error vs an fp64 reference within the
    bound) and ``::test_no_fp32_vocab_buffer_in_bf16`` (no fp32 ``V x D`` tensor allocated, held bytes measured).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class _Live:
    """Bytes of the tensors the loss holds at once (outputs included), to report its working set."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def add(self, *ts: torch.Tensor | None) -> None:
        for t in ts:
            if t is not None:
                self.live += t.numel() * t.element_size()
        self.peak = max(self.peak, self.live)

    def sub(self, *ts: torch.Tensor | None) -> None:
        for t in ts:
            if t is not None:
                self.live -= t.numel() * t.element_size()


class _ChunkedCausalLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        chunk_tokens: int,
        ignore_index: int,
        num_items: Any,
        stats: dict[str, int] | None,
    ) -> torch.Tensor:
        B, T, D = hidden.shape
        V = weight.shape[0]
        dev = hidden.device
        # Same shift as ForCausalLMLoss: pad with ignore_index, drop the first label. Labels (and a host
        # num_items_in_batch) still on the host cross without a host synchronisation: non_blocking from pageable
        # memory is staged at once, where a blocking copy would first wait for every queued kernel.
        target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1).to(dev, non_blocking=True)
        h = hidden.reshape(-1, D)
        N = h.shape[0]
        valid = target != ignore_index
        if num_items is None:
            divisor = valid.sum().to(torch.float32)
        elif isinstance(num_items, torch.Tensor):
            divisor = num_items.to(dev, torch.float32, non_blocking=True)
        else:
            divisor = torch.full((), float(num_items), dtype=torch.float32, device=dev)  # a fill: no copy
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        live = _Live()
        grad_h = torch.empty_like(h) if need_h else None
        # Note: [The lm_head gradient is accumulated in the weight's dtype]
        grad_w = torch.zeros(V, D, dtype=weight.dtype, device=dev) if need_w else None
        grad_b = torch.zeros(V, dtype=torch.float32, device=dev) if need_b else None
        live.add(grad_h, grad_w, grad_b)
        outputs_bytes = live.live
        scale = (1.0 / divisor) if (need_h or need_w or need_b) else None
        total = torch.zeros((), dtype=torch.float32, device=dev)
        chunk_peak = 0
        n_chunks = 0
        for s in range(0, N, chunk_tokens):
            e = min(N, s + chunk_tokens)
            hc, yc, vc = h[s:e], target[s:e], valid[s:e]
            logits = F.linear(hc, weight, bias)
            live.add(logits)
            lf = logits.float()
            if lf.data_ptr() != logits.data_ptr():
                live.add(lf)
                live.sub(logits)
            del logits  # lf holds it when the logits are fp32 already
            logp = torch.log_softmax(lf, dim=-1)
            live.add(logp)
            live.sub(lf)
            del lf
            # nll_loss(sum) on the fp32 log-probabilities: the kernel F.cross_entropy uses.
            total += F.nll_loss(logp, yc, ignore_index=ignore_index, reduction="sum")
            if scale is not None:
                # d(sum CE)/d logits = softmax - onehot on valid rows, 0 on ignored rows; times 1/divisor.
                g = logp.exp_()
                idx = torch.where(vc, yc, torch.zeros_like(yc)).unsqueeze(1)
                g.scatter_add_(1, idx, torch.full_like(idx, -1, dtype=g.dtype))
                g.mul_((vc.to(g.dtype) * scale).unsqueeze(1))
                gm = g.to(weight.dtype)
                if gm.data_ptr() != g.data_ptr():
                    live.add(gm)
                if need_h:
                    torch.mm(gm, weight, out=grad_h[s:e])  # hidden and weight share a dtype (checked)
                if need_w:
                    # fp32: the same fp32 GEMM as before (gm is g); else a compute-dtype GEMM (fp32 sums inside)
                    grad_w.addmm_(gm.t(), hc)
                if need_b:
                    grad_b.add_(g.sum(0))
                if gm.data_ptr() != g.data_ptr():
                    live.sub(gm)
                del gm, g
            chunk_peak = max(chunk_peak, live.peak - outputs_bytes)
            live.sub(logp)
            del logp
            n_chunks += 1
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.shape = hidden.shape
        ctx.w_dtype = weight.dtype
        if stats is not None:
            stats["peak_bytes"] = live.peak
            stats["chunk_peak_bytes"] = chunk_peak
            stats["grad_bytes"] = outputs_bytes
            stats["full_logits_bytes"] = N * V * 4
            stats["chunks"] = n_chunks
        return total / divisor

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w, grad_b = ctx.grads
        ctx.grads = None
        # The stored gradients are ours alone (backward runs once): scale them in place, no extra V x D buffer.
        gh = grad_h.mul_(grad_out).view(ctx.shape) if grad_h is not None else None
        gw = grad_w.mul_(grad_out) if grad_w is not None else None  # already the weight's dtype
        gb = grad_b.mul_(grad_out).to(ctx.w_dtype) if grad_b is not None else None
        return gh, gw, gb, None, None, None, None, None


def chunked_causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = 1024,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
    stats: dict[str, int] | None = None,
) -> torch.Tensor:
    """Causal-LM cross entropy of ``lm_head(hidden_states)`` against ``labels``, computed in chunks of tokens.

    Args:
        hidden_states: ``(B, T, D)`` final hidden states (after the final norm).
        lm_head_weight: ``(V, D)`` lm_head weight (the embedding matrix when tied; gradients reach it either way).
        labels: ``(B, T)`` token ids, ``ignore_index`` on positions without a target; shifted left inside.
        chunk_tokens: tokens per chunk; the working set is about ``chunk_tokens x V x (4 + itemsize)`` bytes.
        ignore_index: label value that contributes nothing.
        num_items_in_batch: when given, the loss is ``sum / num_items_in_batch`` (Trainer's gradient-accumulation
            normalisation), else the mean over non-ignored tokens.
        lm_head_bias: optional ``(V,)`` bias.
        stats: optional dict filled with ``peak_bytes`` (largest working set, outputs included),
            ``chunk_peak_bytes`` (per-chunk part: logits and their gradient), ``grad_bytes`` (stored gradients),
            ``full_logits_bytes`` (what ``B x T x V`` fp32 logits would take) and ``chunks``.

    Returns:
        The fp32 scalar loss; its backward yields the gradients computed in forward times ``grad_output``.
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        got = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        raise ValueError(f"hidden_states must be a (batch, seq, hidden) tensor, got {got}.")
    if not isinstance(lm_head_weight, torch.Tensor) or lm_head_weight.dim() != 2:
        raise ValueError("lm_head_weight must be a (vocab, hidden) tensor.")
    if lm_head_weight.shape[1] != hidden_states.shape[-1]:
        raise ValueError(
            f"lm_head_weight has hidden size {lm_head_weight.shape[1]} but hidden_states {hidden_states.shape[-1]}."
        )
    if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != tuple(hidden_states.shape[:2]):
        got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels must have shape {tuple(hidden_states.shape[:2])} (batch, seq), got {got}.")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be a positive int (e.g. 1024).")
    if num_items_in_batch is not None and not isinstance(num_items_in_batch, int | float | torch.Tensor):
        raise TypeError(f"num_items_in_batch={num_items_in_batch!r} must be an int, a tensor or None.")
    if lm_head_weight.dtype != hidden_states.dtype:
        raise ValueError(
            f"lm_head_weight dtype {lm_head_weight.dtype} differs from hidden_states dtype {hidden_states.dtype}; "
            "cast the model to one dtype."
        )
    return _ChunkedCausalLMLoss.apply(
        hidden_states, lm_head_weight, lm_head_bias, labels, chunk_tokens, ignore_index, num_items_in_batch, stats
    )
