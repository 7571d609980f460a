"""CUDA path of the streaming executor: copy streams, events, pinned memory. Skipped without CUDA.

The bandwidth-bound test makes every layer's H2D copy far longer than its compute (wide layers, 4 tokens), with
prefetch depth 2 and the master changed between steps, so a missing wait (compute before the H2D event, an H2D copy
into a slot before the compute that read it finished, a host write before a D2H copy landed) shows as wrong values.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_model
from test_streaming import padded_batch, plain_grads

from lazytrain_hf.planner.plan import Plan
from lazytrain_hf.streaming import attach

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _to(batch, dev):
    return {k: v.to(dev) for k, v in batch.items()}


def test_cuda_parity_dense():
    """Dense qwen3 in fp32: the same kernels on the same values. Compared with torch.equal (cuBLAS is deterministic
    for a given shape and alignment; slots are 256-byte aligned like cudaMalloc)."""
    dev = torch.device("cuda")
    batch = _to(padded_batch(), dev)
    ref = tiny_model("qwen3").to(dev)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    model = tiny_model("qwen3")
    handle = attach(model, device=dev)
    assert handle.store.pin_memory and handle.store.layers[0].compute_bytes.is_pinned()
    loss = model(**batch).loss
    loss.backward()
    assert torch.equal(loss, ref_loss)
    got = handle.grads()
    for n, g in plain_grads(ref).items():
        assert torch.equal(got[n].to(dev), g), n
    # streamed parameters point at pinned host memory again, resident ones live on the device
    assert model.model.layers[0].mlp.up_proj.weight.device.type == "cpu"
    assert model.model.embed_tokens.weight.device.type == "cuda"
    handle.remove()
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_cuda_bandwidth_bound_layers_three_steps():
    dev = torch.device("cuda")
    cfg = dict(
        hidden_size=1024,
        intermediate_size=8192,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        num_hidden_layers=6,
        vocab_size=256,
    )
    batch = _to(padded_batch(batch=1, seq=4, vocab=256), dev)
    ref = tiny_model("qwen3", **cfg).to(dev)
    model = tiny_model("qwen3", **cfg)
    plan = Plan.default(6, prefetch_depth=2)
    handle = attach(model, plan=plan, device=dev)
    for step in range(3):
        ref.zero_grad(set_to_none=True)
        handle.zero_grad()
        for _micro in range(2):  # second micro-batch: host accumulation on the worker thread
            ref(**batch).loss.backward()
            model(**batch).loss.backward()
        got = handle.grads()
        for n, g in plain_grads(ref).items():
            torch.testing.assert_close(
                got[n].to(dev), g, rtol=0, atol=0, msg=lambda m, n=n, s=step: f"step {s} {n}: {m}"
            )
        # an "optimizer step" on both: master -= 1e-3 * grad, then sync the compute copy
        with torch.no_grad():
            for i, ls in handle.store.layers.items():
                for name in ls.master_views:
                    ls.master_views[name].sub_(1e-3 * ls.grad_views[name])
                handle.sync_compute(i)
            for n, p in ref.named_parameters():
                if ".layers." in n:
                    p.sub_(1e-3 * p.grad)
    handle.remove()


def test_cuda_memory_peak_and_no_host_sync():
    dev = torch.device("cuda")
    cfg = dict(hidden_size=512, intermediate_size=4096, num_hidden_layers=8, vocab_size=256, head_dim=64)
    batch = _to(padded_batch(batch=2, seq=16, vocab=256), dev)
    model = tiny_model("qwen3", **cfg)
    weights = sum(p.numel() * 4 for p in model.parameters())
    handle = attach(model, device=dev)
    model(**batch).loss.backward()  # warm-up
    handle.zero_grad()
    torch.cuda.synchronize()
    handle.reset_peak()
    handle.trace.end_step()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            model(**batch).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # every module of the package (executor, activation engine, loss, lanes), and the executor's own count
    ours = [x for x in w if "lazytrain_hf/" in str(x.filename)]
    assert not ours, [f"{x.filename}:{x.lineno} {x.message}" for x in ours]
    assert handle.trace.current["host_syncs"] == 0, handle.trace.current["sync_reasons"]
    st = handle.memory_stats()
    assert st["device_peak_bytes"] < 0.5 * 2 * weights, (st, weights)
    handle.remove()
