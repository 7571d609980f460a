"""Block checkpointing (``Plan.checkpoint_every = K > 1``, MegaTrain's scheme) executed by the runtime.

Only the input of layers 0, K, 2K, ... is saved (on the device); the other layers of a block save nothing. When the
backward reaches the block's top layer the whole block is recomputed layer by layer from that input, each layer with
its weights fetched and bound for the recomputation (``block_graphs="block"``); or (``block_graphs="layer"``,
MegaTrain's executor) the layers below the top are run under ``no_grad`` keeping each one's output, and each layer's
backward recomputes that one layer with grad from its kept input. On CPU only data moves, so losses and gradients
must equal plain autograd bit for bit (`torch.equal`), dropout included.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_model
from helpers.standalone import attach_standalone
from test_activations import independent_saved_bytes
from test_streaming import assert_grads_equal, hooks_snapshot, plain_grads

from lazytrain_hf import models
from lazytrain_hf.activations import ActivationEngine
from lazytrain_hf.activations.recompute import Recomputer
from lazytrain_hf.planner import baselines, costmodel
from lazytrain_hf.planner.plan import Plan
from lazytrain_hf.streaming import attach

L = 5  # K = 2, 3, 4 all leave a partial last block
B, T = 2, 10


def batch(seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def block_plan(model, K: int, block_graphs: str = "block") -> Plan:
    kinds = models.layer_kinds(model)
    plan = Plan.default(len(kinds), kinds=kinds)
    for lp in plan.layers:
        lp.policy = "recompute"
    plan.checkpoint_every = K
    plan.block_graphs = block_graphs
    return plan.validate()


def blocks(n: int, K: int) -> list[list[int]]:
    return [list(range(s, min(s + K, n))) for s in range(0, n, K)]


def dropout_of(model_type: str) -> float:
    return 0.3 if model_type == "qwen3" else 0.0  # qwen3: the recomputation must replay the dropout masks


_REF: dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}


def reference(model_type: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if model_type not in _REF:
        ref = tiny_model(model_type, num_hidden_layers=L, attention_dropout=dropout_of(model_type)).train()
        torch.manual_seed(5)
        loss = ref(**batch()).loss
        loss.backward()
        _REF[model_type] = (loss.detach(), plain_grads(ref))
    return _REF[model_type]


def instrument(engine: ActivationEngine) -> list[tuple]:
    """Log ``(block layers, layer whose begin_backward ran it or None, count)`` for every block recomputation."""
    log: list[tuple] = []
    current: list[int | None] = [None]
    orig_bb, orig_rb = engine.begin_backward, engine._recompute._recompute_block

    def begin_backward(layer: int) -> None:
        current[0] = layer
        try:
            orig_bb(layer)
        finally:
            current[0] = None

    def recompute_block(block, count, upto=None):
        log.append((block.layers, current[0], count))
        return orig_rb(block, count, upto)

    engine.begin_backward = begin_backward
    engine._recompute._recompute_block = recompute_block
    return log


def stress_slots(handle) -> None:
    """Released slots are filled with NaN bytes and reused oldest first, so a layer rarely gets its previous slot
    back: anything that still reads a released slot (e.g. a weight view recorded by the recomputation) shows."""
    eng = handle.engine
    orig = eng.release

    def release(slot) -> None:
        orig(slot)
        slot.buffer.fill_(255)
        free = eng._free[slot.kind]
        if free and free[-1] is slot:
            free.insert(0, free.pop())

    eng.release = release


# ---------------------------------------------------------------------------------------------------------- executor
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "qwen3_next"])
def test_streamed_block_recompute_bit_exact(model_type, K):
    ref_loss, ref_g = reference(model_type)
    model = tiny_model(model_type, num_hidden_layers=L, attention_dropout=dropout_of(model_type)).train()
    before = hooks_snapshot(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    handle = attach(model, plan=block_plan(model, K), device="cpu")  # default slot pool
    stress_slots(handle)
    engine = handle.activations
    assert isinstance(engine, ActivationEngine) and "checkpoint_every=" + str(K) in repr(engine)
    log = instrument(engine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no slot-pool growth, no broken block chain
        torch.manual_seed(5)
        loss = model(**batch()).loss
        fwd = handle.memory_stats()
        saved = engine.layer_bytes()
        frames = {i: [r() for r in engine._recompute._frames[i]] for i in range(L)}
        structure = [
            (f.layer, f.input is None, f.block.layers, f.block.input is not None) for i in range(L) for f in frames[i]
        ]
        del frames
        fetches_fwd = handle.engine.fetch_count
        loss.backward()
    assert torch.equal(loss.detach(), ref_loss)
    assert_grads_equal(ref_g, handle.grads())

    expected = blocks(L, K)
    x_bytes = B * T * model.config.hidden_size * 4
    # forward: the first layer of each block saved its input on the device, every other layer saved nothing
    assert sorted(saved) == [b[0] for b in expected]
    assert all(saved[b[0]] == {"gpu": x_bytes, "cpu": 0, "nvme": 0} for b in expected), saved
    assert fwd["activation_gpu_bytes"] == len(expected) * x_bytes
    assert fwd["activation_cpu_bytes"] == fwd["activation_nvme_bytes"] == 0
    # one frame per layer call, no frame holds an input; each block holds the input of its first layer
    assert structure == [(i, True, b, True) for b in expected for i in b]
    # backward: each block recomputed once, from the backward pre-hook of its top layer, top block first
    assert log == [(b, b[-1], True) for b in reversed(expected)]
    # weights: one fetch per layer in forward; in backward one per layer (the last one stays bound after its
    # forward) plus, for each block, one for every layer neither the top (bound for its backward) nor the one
    # below it (its backward prefetch is issued before the recomputation and kept)
    assert fetches_fwd == L
    assert handle.engine.fetch_count == 2 * L - 1 + sum(max(0, len(b) - 2) for b in expected)
    assert handle.engine.grown == {}
    after = handle.memory_stats()
    assert after["activation_gpu_bytes"] == after["activation_cpu_bytes"] == 0
    assert engine._recompute._block_of == {} and engine._recompute._open_block is None

    handle.remove()
    assert hooks_snapshot(model) == before
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())  # no optimizer step ran


def test_two_steps_and_megatrain_pool_stay_bounded():
    """Two steps in a row: per-step state is dropped, the default pool never grows, gradients accumulate exactly."""
    ref_loss, ref_g = reference("qwen3")
    model = tiny_model("qwen3", num_hidden_layers=L, attention_dropout=0.3).train()
    handle = attach(model, plan=block_plan(model, 4), device="cpu")
    pool = {k: len(v) for k, v in handle.engine.pools.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            torch.manual_seed(5)
            loss = model(**batch()).loss
            loss.backward()
    assert torch.equal(loss.detach(), ref_loss)
    assert_grads_equal({k: 2 * v for k, v in ref_g.items()}, handle.grads())
    assert {k: len(v) for k, v in handle.engine.pools.items()} == pool
    handle.remove()


# ---------------------------------------------------------------------------------------------------------- standalone
def test_standalone_block_recompute_retain_graph():
    """The engine on an ordinary model (weights by reference): bit-exact, and a second backward over the retained
    graph recomputes each block again."""
    ref = tiny_model("qwen3", num_hidden_layers=L, attention_dropout=0.3).train()
    torch.manual_seed(5)
    ref_loss = ref(**batch()).loss
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    ref_g = plain_grads(ref)

    model = tiny_model("qwen3", num_hidden_layers=L, attention_dropout=0.3).train()
    engine = ActivationEngine(block_plan(model, 3), "cpu")
    handle = attach_standalone(model, engine)
    log = instrument(engine)
    with engine.step():
        torch.manual_seed(5)
        loss = model(**batch()).loss
        loss.backward(retain_graph=True)
        loss.backward()
        del loss
    assert_grads_equal(ref_g, plain_grads(model))
    assert log == [([3, 4], 4, True), ([0, 1, 2], 2, True)] * 2
    assert engine.memory_stats()["gpu_bytes"] == 0
    handle.remove()
    engine.close()


def test_first_unpack_recomputes_block_without_pre_hook():
    """Driven without `begin_backward` (an executor that only calls begin/end_layer), the first unpack of any
    tensor of a block recomputes the whole block, once."""
    ref_loss, ref_g = reference("qwen3")
    model = tiny_model("qwen3", num_hidden_layers=L, attention_dropout=0.3).train()
    engine = ActivationEngine(block_plan(model, 2), "cpu")
    handle = attach_standalone(model, engine)
    log = instrument(engine)
    engine.begin_backward = lambda layer: None
    with engine.step():
        torch.manual_seed(5)
        loss = model(**batch()).loss
        loss.backward()
    assert torch.equal(loss.detach(), ref_loss)
    assert_grads_equal(ref_g, plain_grads(model))
    assert log == [([4], None, True), ([2, 3], None, True), ([0, 1], None, True)]
    handle.remove()
    engine.close()


def test_input_that_is_not_the_previous_output_starts_a_block():
    """A layer whose input is not the previous layer's output (here a hook rescales it) cannot be recomputed from
    that output: it starts a block of its own (with a warning) and gradients stay exact."""

    def rescale(module, args, kwargs):
        return (args[0] * 1.5, *args[1:]), kwargs

    ref = tiny_model("qwen3", num_hidden_layers=L).train()
    ref.model.layers[2].register_forward_pre_hook(rescale, with_kwargs=True)
    ref(**batch()).loss.backward()
    ref_g = plain_grads(ref)

    model = tiny_model("qwen3", num_hidden_layers=L).train()
    model.model.layers[2].register_forward_pre_hook(rescale, with_kwargs=True)  # runs before the engine's pre-hook
    engine = ActivationEngine(block_plan(model, 4), "cpu")
    handle = attach_standalone(model, engine)
    with engine.step():
        with pytest.warns(UserWarning, match="layer 2 starts a new block"):
            loss = model(**batch()).loss
        assert sorted(engine.layer_bytes()) == [0, 2, 4]
        loss.backward()
    assert_grads_equal(ref_g, plain_grads(model))
    handle.remove()
    engine.close()


def test_unpack_outside_backward_keeps_nothing():
    """Reading a saved tensor of a block layer outside backward recomputes the block up to that layer, keeps
    nothing, and the backward afterwards is still exact."""
    ref_loss, ref_g = reference("qwen3_moe")
    model = tiny_model("qwen3_moe", num_hidden_layers=L).train()
    engine = ActivationEngine(block_plan(model, 4), "cpu")
    handle = attach_standalone(model, engine)
    outs = {}
    hook = model.model.layers[2].register_forward_hook(lambda m, a, o: outs.setdefault("h", o))
    with engine.step():
        torch.manual_seed(5)
        loss = model(**batch()).loss
        held = engine.memory_stats()["gpu_bytes"]
        node, seen = outs["h"].grad_fn, set()
        stack, read = [node], None
        while stack and read is None:  # the first node of layer 2's graph with a saved tensor
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            for name in ("_saved_self", "_saved_other", "_saved_result"):
                val = getattr(fn, name, None)
                if isinstance(val, torch.Tensor):
                    read = val
                    break
            stack.extend(n for n, _ in fn.next_functions)
        assert read is not None
        assert engine.memory_stats()["gpu_bytes"] == held  # nothing recorded
        loss.backward()
    hook.remove()
    assert torch.equal(loss.detach(), ref_loss)
    assert_grads_equal(ref_g, plain_grads(model))
    handle.remove()
    engine.close()


# ---------------------------------------------------------------------------------------------------------- memory
def stage_model_peak(plan: Plan, cm: costmodel.CostModel) -> int:
    """Device bytes of saved activations at the worst stage under the planner's stage model for block checkpointing
    (`lazytrain_hf.planner.milp.evaluate_plan`, ``K > 1``): the checkpoint of block ``[j, j + K)`` lives from ``F j``
    to ``B j``; every layer ``k`` of the block holds its ``keep`` bytes from the block's recomputation at ``B`` of its
    top layer until ``B k`` (``block_graphs="block"``), or its input from then until ``B k`` (above ``j``) and its
    ``keep`` bytes during ``B k`` only (``"layer"``)."""
    n, K = plan.num_layers, plan.checkpoint_every
    S = 2 * n + 1
    mem = [0] * S

    def alive(lo: int, hi: int, nbytes: int) -> None:
        for s in range(lo, hi + 1):
            mem[s] += nbytes

    for b in blocks(n, K):
        alive(b[0], 2 * n - b[0], cm.layers[b[0]].input_bytes)
        for k in b:
            if plan.block_graphs == "block":
                alive(2 * n - b[-1], 2 * n - k, cm.layers[k].saved_bytes)
                continue
            if k > b[0]:
                alive(2 * n - b[-1], 2 * n - k, cm.layers[k].input_bytes)
            alive(2 * n - k, 2 * n - k, cm.layers[k].saved_bytes)
    return max(mem)


@pytest.mark.parametrize("graphs", ["layer", "block"])
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_megatrain_plan_gpu_peak(model_type, graphs):
    """The `megatrain` baseline (K=4; ``block_graphs="layer"``, and the same plan in ``"block"`` mode) run by the
    executor: the measured gpu-tier peak of saved activations equals an independent count exactly (block inputs
    between forward and backward; in block b's backward, the inputs of the blocks below plus, in ``"block"`` mode,
    everything block b's layers save, in ``"layer"`` mode block b's input, the kept inputs of its layers up to k and
    what layer k saves) and the planner's stage model within 10%."""
    n, Bm, Tm = 6, 2, 16
    model = tiny_model(model_type, num_hidden_layers=n).train()
    ids = torch.randint(0, 128, (Bm, Tm), generator=torch.Generator().manual_seed(0))
    cfg = model.config
    cm = costmodel.CostModel.from_config(cfg, "cpu", seq_len=Tm, micro_batch_size=Bm, dtype_bytes=4,
                                         attn_implementation=cfg._attn_implementation)  # fmt: skip
    plan = baselines.make_baseline("megatrain", cm)
    assert plan.checkpoint_every == 4 and plan.source == "baseline:megatrain" and plan.block_graphs == "layer"
    plan.block_graphs = graphs

    keep = independent_saved_bytes(model, ids)  # per layer, plain autograd
    x = Bm * Tm * cfg.hidden_size * 4
    exact = len(blocks(n, 4)) * x  # end of forward: the block inputs only
    for j, b in enumerate(blocks(n, 4)):
        if graphs == "block":
            exact = max(exact, j * x + sum(keep[k] for k in b))
        else:  # what layer k saves includes its input (its kept one; block b's input for k = b[0])
            exact = max(exact, *(j * x + (k - b[0]) * x + keep[k] for k in b))

    handle = attach(model, plan=plan, device="cpu")
    torch.manual_seed(7)
    loss = model(ids, labels=ids).loss
    assert handle.memory_stats()["activation_gpu_bytes"] == len(blocks(n, 4)) * x
    loss.backward()
    measured = handle.memory_stats()["activation_gpu_peak_bytes"]
    assert handle.activations.memory_stats()["gpu_peak_bytes"] == measured
    handle.remove()
    assert measured == exact, (measured, exact, keep)
    predicted = stage_model_peak(plan, cm)
    assert abs(measured - predicted) <= 0.10 * predicted, (measured, predicted)


# ---------------------------------------------------------------------------------------------------------- trainer
def test_lazy_trainer_megatrain_runs_block_recompute(tmp_path, monkeypatch):
    """`planner_policy="megatrain"` trains through block recomputation (the loss parity with the unstreamed run is
    `test_trainer_lazy.test_streamed_training_matches_unstreamed[megatrain-None]`)."""
    from trainer_fixtures import make_trainer

    seen: list[int] = []
    orig = Recomputer._run_nograd

    def spy(self, frame, x):
        seen.append(frame.layer)
        return orig(self, frame, x)

    monkeypatch.setattr(Recomputer, "_run_nograd", spy)
    tr = make_trainer(tmp_path, max_steps=1, planner_policy="megatrain", planner_warmup_steps=0)
    tr.train()
    assert tr.lazy_plan.checkpoint_every == 4 and tr.lazy_plan.block_graphs == "layer"
    assert seen == [0, 1, 2]


# ---------------------------------------------------------------------------------------------------------- layer mode
def instrument_layer(engine: ActivationEngine) -> tuple[list[tuple], list[tuple]]:
    """Log the ``no_grad`` forwards ``(layer, begin_backward layer or None)`` and the with-grad recomputations
    ``(layer, kept inputs of the block then, device bytes of recorded tensors then)`` of ``block_graphs="layer"``."""
    nograd: list[tuple] = []
    withgrad: list[tuple] = []
    rec = engine._recompute
    current: list[int | None] = [None]
    orig_bb, orig_ng, orig_rf = engine.begin_backward, rec._run_nograd, rec._run_forward

    def begin_backward(layer: int) -> None:
        current[0] = layer
        try:
            orig_bb(layer)
        finally:
            current[0] = None

    def run_nograd(frame, x):
        nograd.append((frame.layer, current[0]))
        return orig_ng(frame, x)

    def run_forward(frame, x, count, weight_refs=False):
        kept = sorted(f.layer for f in frame.block.frames if f.input is not None) if frame.block else None
        withgrad.append((frame.layer, kept, count))
        return orig_rf(frame, x, count, weight_refs)

    engine.begin_backward = begin_backward
    rec._run_nograd = run_nograd
    rec._run_forward = run_forward
    return nograd, withgrad


@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "qwen3_next"])
def test_streamed_layer_graphs_bit_exact(model_type, K):
    """``block_graphs="layer"`` on the streaming executor: losses and gradients equal plain autograd bit for bit;
    each block's layers below the top run once under ``no_grad`` from its top layer's backward stage, each layer is
    recomputed once with grad from its kept input; weights are fetched as often as in ``"block"`` mode."""
    ref_loss, ref_g = reference(model_type)
    model = tiny_model(model_type, num_hidden_layers=L, attention_dropout=dropout_of(model_type)).train()
    handle = attach(model, plan=block_plan(model, K, "layer"), device="cpu")
    stress_slots(handle)
    engine = handle.activations
    nograd, withgrad = instrument_layer(engine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.manual_seed(5)
        loss = model(**batch()).loss
        saved = engine.layer_bytes()
        loss.backward()
    assert torch.equal(loss.detach(), ref_loss)
    assert_grads_equal(ref_g, handle.grads())

    expected = blocks(L, K)
    x_bytes = B * T * model.config.hidden_size * 4
    assert sorted(saved) == [b[0] for b in expected]  # the forward is the same as in "block" mode
    assert nograd == [(k, b[-1]) for b in reversed(expected) for k in b[:-1]]
    # layer k recomputed with grad at its backward: the inputs of the block layers k' <= k above the first are kept
    # (those above k were released by their backward)
    assert withgrad == [(k, [j for j in b[1:] if j <= k], True) for b in reversed(expected) for k in reversed(b)]
    assert handle.engine.fetch_count == 2 * L - 1 + sum(max(0, len(b) - 2) for b in expected)
    assert handle.engine.grown == {}
    after = handle.memory_stats()
    assert after["activation_gpu_bytes"] == after["activation_cpu_bytes"] == 0
    assert engine.memory_stats()["gpu_peak_bytes"] >= x_bytes
    handle.remove()


def test_standalone_layer_graphs_retain_graph_and_no_pre_hook():
    """The engine on an ordinary model under ``block_graphs="layer"``: a second backward over the retained graph
    reuses the kept inputs (no second ``no_grad`` pass) and recomputes each layer again; without `begin_backward`
    the first unpack of a layer runs the ``no_grad`` pass up to it. Both bit-exact."""
    ref = tiny_model("qwen3", num_hidden_layers=L, attention_dropout=0.3).train()
    torch.manual_seed(5)
    ref_loss = ref(**batch()).loss
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    ref_g = plain_grads(ref)

    model = tiny_model("qwen3", num_hidden_layers=L, attention_dropout=0.3).train()
    engine = ActivationEngine(block_plan(model, 3, "layer"), "cpu")
    handle = attach_standalone(model, engine)
    nograd, withgrad = instrument_layer(engine)
    with engine.step():
        torch.manual_seed(5)
        loss = model(**batch()).loss
        loss.backward(retain_graph=True)
        loss.backward()
        del loss
    assert_grads_equal(ref_g, plain_grads(model))
    assert nograd == [(3, 4), (0, 2), (1, 2)]
    assert [k for k, _, _ in withgrad] == [4, 3, 2, 1, 0] * 2
    assert engine.memory_stats()["gpu_bytes"] == 0
    handle.remove()
    engine.close()

    ref_loss, ref_g = reference("qwen3")
    model = tiny_model("qwen3", num_hidden_layers=L, attention_dropout=0.3).train()
    engine = ActivationEngine(block_plan(model, 2, "layer"), "cpu")
    handle = attach_standalone(model, engine)
    nograd, withgrad = instrument_layer(engine)
    engine.begin_backward = lambda layer: None
    with engine.step():
        torch.manual_seed(5)
        loss = model(**batch()).loss
        loss.backward()
    assert torch.equal(loss.detach(), ref_loss)
    assert_grads_equal(ref_g, plain_grads(model))
    assert nograd == [(2, None), (0, None)]
    handle.remove()
    engine.close()


def test_unpack_outside_backward_keeps_nothing_layer_graphs():
    """Reading a saved tensor of a block layer outside backward under ``block_graphs="layer"`` runs the ``no_grad``
    pass up to it and recomputes that layer, keeping nothing; the backward afterwards is exact."""
    ref_loss, ref_g = reference("qwen3_moe")
    model = tiny_model("qwen3_moe", num_hidden_layers=L).train()
    engine = ActivationEngine(block_plan(model, 4, "layer"), "cpu")
    handle = attach_standalone(model, engine)
    outs = {}
    hook = model.model.layers[2].register_forward_hook(lambda m, a, o: outs.setdefault("h", o))
    with engine.step():
        torch.manual_seed(5)
        loss = model(**batch()).loss
        held = engine.memory_stats()["gpu_bytes"]
        read = None
        stack, seen = [outs["h"].grad_fn], set()
        while stack and read is None:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            for name in ("_saved_self", "_saved_other", "_saved_result"):
                val = getattr(fn, name, None)
                if isinstance(val, torch.Tensor):
                    read = val
                    break
            stack.extend(n for n, _ in fn.next_functions)
        assert read is not None
        assert engine.memory_stats()["gpu_bytes"] == held
        assert all(f.input is None for f in engine._recompute._block_of[2]().frames[1:])
        loss.backward()
    hook.remove()
    assert torch.equal(loss.detach(), ref_loss)
    assert_grads_equal(ref_g, plain_grads(model))
    handle.remove()
    engine.close()
