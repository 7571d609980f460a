"""Streamed embeddings, final norm and lm_head (``plan.stream_embeddings=True``) on CPU.

The embedding and the head then live in the host store like decoder layers (Note: [Streamed embeddings and head] in
``lazytrain_hf/streaming/hooks.py``). On CPU the executor only moves data, so in fp32 the loss and every gradient
are bit-identical to the un-hooked model (`torch.equal`), tied embeddings included.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_streaming import assert_grads_equal, hooks_snapshot, padded_batch, plain_grads
from trainer_fixtures import make_trainer

from lazytrain_hf import models
from lazytrain_hf.planner.plan import Plan
from lazytrain_hf.streaming import attach, chunked_causal_lm_loss
from lazytrain_hf.streaming.hooks import EMBED_KEY

CHUNK = 7  # tokens per loss chunk: several chunks per micro-batch


def streamed_plan(model, **kw) -> Plan:
    kinds = models.layer_kinds(model)
    return Plan.default(len(kinds), kinds=kinds, stream_embeddings=True, loss_chunk_tokens=CHUNK, **kw)


def reference_chunked_loss(model, batch) -> torch.Tensor:
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    return chunked_causal_lm_loss(hidden, model.lm_head.weight, batch["labels"], chunk_tokens=CHUNK)


CASES = [("qwen3", {}), ("qwen3", {"tie_word_embeddings": True}), ("qwen3_moe", {})]


@pytest.mark.parametrize("path", ["chunked", "plain"])
@pytest.mark.parametrize("model_type,overrides", CASES, ids=["qwen3", "qwen3-tied", "qwen3_moe"])
def test_two_micro_batches_bit_exact(model_type, overrides, path):
    """Two padded micro-batches through `causal_lm_loss` (chunked) or `model(...)` (plain): same losses and
    accumulated gradients as the un-hooked model, and the units really went through transient slots."""
    batches = [padded_batch(seed=1), padded_batch(seed=2)]
    ref = tiny_model(model_type, **overrides)
    ref_losses = []
    for b in batches:
        loss = reference_chunked_loss(ref, b) if path == "chunked" else ref(**b).loss
        (loss / 2).backward()
        ref_losses.append(loss.detach())

    model = tiny_model(model_type, **overrides)
    tied = models.ties_embeddings(model)
    assert tied == bool(overrides.get("tie_word_embeddings"))
    handle = attach(model, plan=streamed_plan(model), device="cpu")
    L = model.config.num_hidden_layers
    assert sorted(handle.store.layers) == [EMBED_KEY, *range(L), L]
    head_names = sorted(handle.store.layers[L].params)
    assert head_names == (["model.norm.weight"] if tied else ["lm_head.weight", "model.norm.weight"])
    pool_bytes = handle.memory_stats()["slot_bytes"]
    for b in batches:
        loss = handle.causal_lm_loss(model, b) if path == "chunked" else model(**b).loss
        (loss / 2).backward()
        assert torch.equal(loss, ref_losses.pop(0))
        # transient slots are gone once backward ended; the parameters point at their host copies again
        assert handle.memory_stats()["slot_bytes"] == pool_bytes
        for key in (EMBED_KEY, L):
            ls = handle.store.layers[key]
            assert all(p.data_ptr() == ls.compute_views[n].data_ptr() and p.grad is None for n, p in ls.params.items())
    ref_g = plain_grads(ref)
    got = handle.grads()
    assert_grads_equal(ref_g, got)
    # per micro-batch: every layer and both units fetched once forward, layers once more backward but the last
    # (kept bound), the embedding once more for the tied lm_head
    assert handle.memory_stats()["fetches"] == 2 * (2 * L - 1 + 2 + int(tied))
    # squared norms cover the units (the accumulated host gradient, Note: [Squared norms of accumulated gradients])
    sq = handle.grad_sq_norms()
    assert sq["resident"] == 0.0
    for key in (EMBED_KEY, L):
        flat = handle.store.layers[key].grad
        assert sq[key] == pytest.approx(float(flat.double().square().sum()), rel=1e-6)
    total = sum(float(g.double().square().sum()) for g in ref_g.values())
    assert handle.global_grad_norm() ** 2 == pytest.approx(total, rel=1e-6)
    handle.remove()


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}], ids=["untied", "tied"])
def test_remove_round_trip_and_generate(overrides):
    model = tiny_model("qwen3", **overrides)
    ref = tiny_model("qwen3", **overrides)
    params = {n: p for n, p in model.named_parameters()}
    hooks = hooks_snapshot(model)
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)

    handle = attach(model, plan=streamed_plan(model), device="cpu")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, want)
    assert handle.memory_stats()["slot_bytes"] == sum(s.nbytes for p in handle.engine.pools.values() for s in p)
    model(**padded_batch()).loss.backward()
    handle.remove()

    assert {n: p for n, p in model.named_parameters()} == params  # same Parameter objects
    assert hooks_snapshot(model) == hooks
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == bool(overrides)
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), n
    assert all(p.grad is None for p in model.parameters())
    # the model trains plainly again
    model(**padded_batch()).loss.backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_device_peak_lower_by_embedding_and_head():
    """With a large vocabulary the embedding and lm_head dominate. Resident, they and their gradients stay on the
    device; streamed, the head is there only during its stage and the embedding only for its lookup. With layers
    recomputed and a small loss chunk (so the kept activations and the loss working set are small), the device
    peak drops by about the embedding + lm_head bytes (CPU accounting, deterministic)."""
    batch = padded_batch(batch=2, seq=16, vocab=4096)
    peaks, after = {}, {}
    for stream in (False, True):
        model = tiny_model("qwen3", vocab_size=4096)
        embed_bytes = model.model.embed_tokens.weight.numel() * 4
        head_bytes = model.lm_head.weight.numel() * 4
        kinds = models.layer_kinds(model)
        plan = Plan.default(len(kinds), kinds=kinds, stream_embeddings=stream, loss_chunk_tokens=2)
        for lp in plan.layers:
            lp.policy = "recompute"
        handle = attach(model, plan=plan, device="cpu")
        handle.reset_peak()
        handle.causal_lm_loss(model, batch).backward()
        stats = handle.memory_stats()
        peaks[stream], after[stream] = stats["device_peak_bytes"], stats["device_bytes"]
        if stream:
            assert stats["resident_bytes"] < embed_bytes // 100  # only buffers (rotary) stay on the device
            # fp32: the master is the compute copy (Note: [Compute copy aliases the fp32 master] in store.py)
            assert stats["host_compute_bytes"] >= embed_bytes + head_bytes
            assert stats["host_grad_bytes"] >= embed_bytes + head_bytes
        handle.remove()
    saved = peaks[False] - peaks[True]
    assert saved >= 0.9 * (embed_bytes + head_bytes), (peaks, embed_bytes, head_bytes)
    # after backward the resident weights and their gradients are on the device; streamed, none of them
    assert after[False] - after[True] >= 2 * (embed_bytes + head_bytes), after


def test_lazytrainer_stream_embeddings(tmp_path):
    """LazyTrainer end to end: the layer-wise optimizer updates the streamed units; losses match the unstreamed
    run (tolerance of tests/test_trainer_lazy.py), and overlapping the optimizer with the forward is bit-identical."""
    from test_trainer_lazy import _assert_losses_close, _weights

    ref = make_trainer(tmp_path / "ref", max_steps=4, stream=False, optim_hybrid_8bit=True)
    ref.train()
    runs = {}
    for overlap in (False, True):
        tr = make_trainer(
            tmp_path / f"ov{overlap}",
            max_steps=4,
            planner_policy="default",
            stream_embeddings=True,
            optim_overlap_forward=overlap,
        )
        tr.train()
        assert tr.lazy_plan.stream_embeddings
        runs[overlap] = (tr.loss_recorder.losses, _weights(tr.model))
        _assert_losses_close(tr.loss_recorder.losses, ref.loss_recorder.losses)
        w, ref_w = runs[overlap][1], _weights(ref.model)
        for k in ref_w:
            torch.testing.assert_close(w[k], ref_w[k], rtol=1e-4, atol=1e-6, msg=k)
        # the embedding and the head were trained (not left at their initial values)
        init = tiny_model("qwen3", seed=1)
        for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            assert not torch.equal(w[k], init.state_dict()[k]), k
    assert runs[False][0] == runs[True][0]
    for k, v in runs[False][1].items():
        assert torch.equal(v, runs[True][1][k]), k


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_bf16_compute_copy_of_an_fp32_model_streams_its_embeddings(tmp_path, model_type):
    """``bf16=True`` on an fp32 model with ``stream_embeddings``: the embedding and head units get a bf16 compute copy
    like the decoder layers (regression: they kept an fp32 copy, and the first layer refused fp32 hidden states), and
    training is bit-exact with the embeddings resident in bf16."""
    runs = {}
    for streamed in (False, True):
        t = make_trainer(
            tmp_path / str(streamed), max_steps=3, planner_policy="default", bf16=True, stream_embeddings=streamed,
            model_type=model_type,
        )  # fmt: skip
        t.train()
        runs[streamed] = (t.loss_recorder.losses, {n: p.detach().clone() for n, p in t.model.named_parameters()})
    (la, wa), (lb, wb) = runs[False], runs[True]
    assert la == lb
    assert all(p.dtype == torch.float32 for p in wb.values())  # the fp32 masters came back
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


def test_milp_plans_the_streamed_embeddings_it_trains_with(tmp_path):
    """``planner_policy="milp"`` with ``stream_embeddings``: the solver plans the embedding and head streamed, so the
    plan's predictions are the stage model's of the plan the executor runs (regression: it planned them resident and
    the flag was set afterwards, predicting a device peak that counted the resident embedding, head and their held
    gradients the run never has)."""
    from lazytrain_hf.planner import milp

    tr = make_trainer(
        tmp_path, max_steps=1, planner_policy="milp", planner_hardware="h800", planner_warmup_steps=0,
        stream_embeddings=True,
    )  # fmt: skip
    plan = tr.make_plan()
    cm = tr.lazy_cost_model
    assert plan.source == "milp" and plan.stream_embeddings
    ev = milp.evaluate_plan(plan, cm)
    assert plan.predicted["peak_gpu_bytes"] == ev.peak_gpu_bytes
    assert plan.predicted["step_time_s"] == pytest.approx(ev.step_time_s, rel=1e-9)
    assert cm.stream_embeddings  # the cost model the baselines and the simulator are given streams them too
