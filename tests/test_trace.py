"""The executor's trace is the planner's referee: for every plan (the plan space of ``test_plan_space.py``), the
bytes the executor moved per lane in each optimizer step equal the plan's ``predicted["bytes_per_step"]`` exactly,
and every scheduled transfer is issued in the stage ``Plan.issue_schedule()`` names (or later, when it found no
free slot). Runs under the simulated asynchronous CPU engine like the rest of the suite."""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter

import pytest
import torch
from conftest import offload_step_device_bytes, tiny_model
from hypothesis import given, settings
from test_plan_space import _SETTINGS, STEPS, cases, keep_all_plan, write_plan
from trainer_fixtures import token_dataset

from lazytrain_hf import LazyTrainer, LazyTrainingArguments, models
from lazytrain_hf.planner.plan import LayerPlan, Plan
from lazytrain_hf.streaming.trace import LANES, Trace


def traced_run(model_type: str, plan: Plan, ga: int, dtype: torch.dtype, **extra) -> tuple[dict, dict]:
    """Train ``STEPS`` steps under ``plan``; returns (lazytrain_trace.json, lazytrain_plan.json) as written."""
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "nvme"))
        out = os.path.join(tmp, "out")
        model = tiny_model(model_type, seed=1).to(dtype)
        args = LazyTrainingArguments(
            output_dir=out,
            per_device_train_batch_size=plan.micro_batch_size,
            gradient_accumulation_steps=ga,
            max_steps=STEPS,
            learning_rate=1e-2,
            max_grad_norm=1.0,
            report_to=[],
            seed=5,
            use_cpu=True,
            save_strategy="no",
            planner_plan=write_plan(plan, tmp),
            activation_nvme_dir=os.path.join(tmp, "nvme"),
            state_nvme_dir=os.path.join(tmp, "nvme"),  # for the plan's state_nvme units
            **extra,
        )
        n = STEPS * ga * plan.micro_batch_size
        LazyTrainer(model=model, args=args, train_dataset=token_dataset(n=n, T=10)).train()
        with open(os.path.join(out, "lazytrain_trace.json")) as f:
            trace = json.load(f)
        with open(os.path.join(out, "lazytrain_plan.json")) as f:
            written = json.load(f)
        return trace, written


def check_trace(case) -> None:
    model_type, plan, ga, dtype = case[:4]  # the trace does not depend on what is frozen (cases() draws it too)
    trace, written = traced_run(model_type, plan, ga, dtype)
    predicted = written["predicted"]["bytes_per_step"]
    assert len(trace["steps"]) == STEPS
    for s in trace["steps"]:
        diff = {k: s["bytes"][k] - predicted[k] for k in LANES if s["bytes"][k] != predicted[k]}
        by = {}
        for t in s["transfers"]:
            key = (t["lane"], t["what"], t["layer"])
            by[key] = by.get(key, 0) + t["bytes"]
        assert not diff, (
            f"{model_type} ga={ga} {dtype} step {s['step']}: trace - prediction per lane {diff}\n"
            f"trace by (lane, what, layer): {sorted(by.items(), key=str)}\nplan:\n{plan.table()}"
        )
    # every scheduled fetch / reload issued at its stage, or later when the pool had no free slot
    sched = {(w, i): s for s, items in plan.issue_schedule().items() for w, i in items}
    first = trace["steps"][0]["transfers"]
    for t in first:
        if t["what"] == "reload":
            assert t["stage_issued"] >= sched[("reload", t["layer"])], t


_FAST = dict(_SETTINGS, max_examples=8)


@settings(**_FAST)
@given(cases())
def test_trace_bytes_equal_prediction(case):
    check_trace(case)


@pytest.mark.slow
@settings(**{**_SETTINGS, "max_examples": 60, "derandomize": False})
@given(cases())
def test_trace_bytes_equal_prediction_slow(case):
    check_trace(case)


@pytest.mark.parametrize("graphs", ["block", "layer"])
def test_trace_bytes_equal_prediction_under_block_checkpointing(graphs):
    """Block checkpointing every 3 layers in both `Plan.block_graphs` modes, backward fetches one and two stages
    ahead: the recomputation fetches (``"layer"``: for the ``no_grad`` pass) are the ones the schedule predicts."""
    kinds = models.layer_kinds(tiny_model("qwen3"))
    plan = Plan(
        layers=[
            LayerPlan(index=i, kind=k, policy="recompute", fetch_bwd_ahead=1 + i % 2) for i, k in enumerate(kinds)
        ],
        micro_batch_size=2,
        seq_len=10,
        checkpoint_every=3,
        block_graphs=graphs,
        source="file",
    )
    check_trace(("qwen3", plan, 2, torch.float32))


def sync_plan(kinds: list[str], overlap: bool) -> Plan:
    """Keep, offload to the CPU, recompute from a CPU-held input and a resident layer: every moving part."""
    policies = ["keep", "offload_cpu", "recompute", "keep"]
    return Plan(
        layers=[
            LayerPlan(
                index=i,
                kind=k,
                policy=policies[i % 4],
                input_tier="cpu" if policies[i % 4] == "recompute" else "gpu",
                resident=i % 4 == 3,
            )
            for i, k in enumerate(kinds)
        ],
        micro_batch_size=2,
        seq_len=10,
        optimizer_overlap=overlap,
        source="file",
    )


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("ga", [1, 2])
def test_host_syncs_per_step(ga, overlap):
    """The training thread blocks on device work once per optimizer step, to take the gradients over
    (``engine.synchronize``: the optimizer needs every accumulator and the norm). Not at the end of each micro-batch
    (Note: [The end of a step does not block the host] in activations/engine.py), not for the optimizer's
    compute-copy writes or resident uploads (fp32 on the CPU device: resident parameters are their own masters)."""
    kinds = models.layer_kinds(tiny_model("qwen3").config)
    trace, _ = traced_run("qwen3", sync_plan(kinds, overlap), ga, torch.float32)
    for s in trace["steps"]:
        assert s["sync_reasons"] == {"engine.synchronize": 1}, (s["step"], s["sync_reasons"])
        assert s["host_syncs"] == 1


def test_gradients_cross_in_their_own_dtype():
    """A bf16 model's gradients move 2 bytes per parameter (Note: [Gradients cross in their own dtype]): every
    gradient transfer of the trace is bf16 and the D2H bytes per step equal the streamed trainable parameters x 2."""
    model_type = "qwen3"
    kinds = models.layer_kinds(tiny_model(model_type).config)
    plan = keep_all_plan(kinds, stream_embeddings=False, loss_chunk_tokens=1024)
    trace, _ = traced_run(model_type, plan, 1, torch.bfloat16)
    model = tiny_model(model_type)
    n = sum(p.numel() for layer in models.decoder_layers(model) for p in layer.parameters())
    for s in trace["steps"]:
        grads = [t for t in s["transfers"] if t["what"] == "grad" and t["layer"] is not None]
        assert grads and all(t["dtype"] == "bfloat16" for t in grads), grads[:3]
        assert sum(t["bytes"] for t in grads) == 2 * n


def test_trace_unit():
    trace = Trace(keep_steps=1)
    trace.transfer("h2d", 10, torch.bfloat16, 0, "fetch_fwd")
    trace.host_sync("x")
    with trace.in_step(0):
        trace.end_step()  # records of another thread's step stay where they belong
        trace.transfer("d2h", 4, torch.float32, None, "grad")
    trace.transfer("h2d", 7, None, 1, "fetch_fwd")
    trace.end_step()
    steps = trace.steps
    assert [s["bytes"] for s in steps] == [
        {"h2d": 10, "d2h": 4, "nvme_read": 0, "nvme_write": 0, "net": 0},
        {"h2d": 7, "d2h": 0, "nvme_read": 0, "nvme_write": 0, "net": 0},
    ]
    assert steps[0]["host_syncs"] == 1 and steps[1]["transfers"] == []  # details of the first keep_steps only
    with trace.paused():
        trace.transfer("h2d", 1, None, 0, "fetch_fwd")
    assert trace.current["bytes"]["h2d"] == 0
    with pytest.raises(ValueError, match="lane='pcie'"):
        trace.transfer("pcie", 1, None, 0, "x")
    with pytest.raises(ValueError, match="keep_steps=-1"):
        Trace(keep_steps=-1)
    from lazytrain_hf.streaming.trace import TOTALS_KEPT

    for _ in range(TOTALS_KEPT + 50):  # a long run keeps the first steps and the last TOTALS_KEPT totals only
        trace.end_step()
    kept = [s["step"] for s in trace.steps]
    assert kept[0] == 0 and len(kept) == 1 + TOTALS_KEPT and kept[-1] == trace.step_index - 1


def test_warmup_times_exclude_transfers(monkeypatch):
    """The warm-up's compute spans start once a layer's weights are bound: waiting 0.3 s for a layer's weights is
    not counted as compute (timing the hooks' wall time, as before, would give >= 0.3 s for every layer)."""
    import time as _time

    from lazytrain_hf.streaming.engine import TransferEngine
    from lazytrain_hf.training.planning import time_streamed_layers

    model = tiny_model("qwen3", seed=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 10))
    batch = {"input_ids": ids, "labels": ids}
    wait_ready = TransferEngine.wait_ready

    def slow_wait_ready(self, *a, **k):
        _time.sleep(0.3)  # the compute side waits for a slow copy
        return wait_ready(self, *a, **k)

    monkeypatch.setattr(TransferEngine, "wait_ready", slow_wait_ready)
    fwd, bwd = time_streamed_layers(model, batch, torch.device("cpu"), 2)
    assert len(fwd) == len(bwd) == model.config.num_hidden_layers
    assert all(0 < t < 0.15 for t in fwd + bwd), (fwd, bwd)


def test_warmup_measures_two_batch_sizes(monkeypatch):
    """Note: [The warm-up measures two batch sizes]: timed at 1 and 2 sequences, the time at B is the line through
    them (never below the time at 2); no timed pass runs at the training batch."""
    from lazytrain_hf.training import planning

    seen = []

    def fake(model, batch, device, passes):
        b = int(batch["input_ids"].shape[0])
        seen.append(b)
        return ([0.010 * b + 0.002, 0.5], [0.030 * b + 0.001, 0.7])

    monkeypatch.setattr(planning, "time_streamed_layers", fake)
    ids = torch.zeros(6, 4, dtype=torch.long)
    model = tiny_model("qwen3")
    fwd, bwd = planning.measure_layer_times(model, {"input_ids": ids, "labels": ids}, torch.device("cpu"), 2)
    assert seen == [1, 2]
    assert fwd == pytest.approx([0.062, 0.5]) and bwd == pytest.approx([0.181, 0.7])
    seen.clear()
    planning.measure_layer_times(model, {"input_ids": ids[:2], "labels": ids[:2]}, torch.device("cpu"), 2)
    assert seen == [1, 2]


def test_copies_in_flight_are_bounded(async_engine, monkeypatch):
    """Note: [Two stages of copies in flight]: with a D2H lane far slower than compute, the sources of offload
    copies still on the device never exceed the two layers before the one computing (plus its own), so the peak the
    planner charges holds; without the wait every layer's offload would be in flight at the end of the forward."""
    from lazytrain_hf.streams import MAX_DELAY_ENV

    monkeypatch.setenv(MAX_DELAY_ENV, "0.05")
    _, seen, per_layer = offload_step_device_bytes(8)
    assert len(seen) == 8 and per_layer > 0
    assert max(seen) <= 3 * per_layer, (max(seen) / per_layer, seen)


def test_copies_in_flight_are_bounded_after_the_last_forward(async_engine, monkeypatch):
    """Note: [Two stages of copies in flight] past the forward: the head stage waits for the offload copies of layer
    ``L - 2`` and the last layer's backward stage for those of ``L - 1``, so when the backward reaches a layer the
    device holds at most two layers' saved tensors (offload sources and reloads together). Without those waits the
    last two layers' sources stayed on the device, beside the reloads of the same tensors, when the D2H lane lags:
    the stage model's charge (a source until the stage after its forward) did not hold."""
    from lazytrain_hf.streams import MAX_DELAY_ENV

    monkeypatch.setenv(MAX_DELAY_ENV, "0.05")
    at_backward: list[int] = []

    def inspect(handle):  # the device's saved tensors as the backward reaches each layer
        for layer in models.decoder_layers(handle.model):
            layer.register_full_backward_pre_hook(
                lambda *_: at_backward.append(handle.activations.memory_stats()["gpu_bytes"])
            )

    _, seen, per_layer = offload_step_device_bytes(4, inspect=inspect)
    assert len(at_backward) == 4 and per_layer > 0
    assert max(at_backward) <= 2 * per_layer, ([b / per_layer for b in at_backward], per_layer)


@pytest.mark.sync_engine
@settings(**{**_SETTINGS, "max_examples": 12})
@given(cases())
def test_issue_order_follows_the_schedule(case):
    """On the synchronous engine with no optimizer overlap (no fetch is deferred: the pool holds the plan's
    depth), every weight fetch and reload of a step is issued in the stage `schedule.step_transfers` names, and in
    its order inside the stage: the simulator replays what the executor does."""
    from lazytrain_hf.planner import schedule

    model_type, plan, ga, dtype = case[:4]  # the trace does not depend on what is frozen (cases() draws it too)
    plan.optimizer_overlap = False
    trace, written = traced_run(model_type, plan, 1, dtype)
    expected = [
        (t.stage, t.layer, "reload" if t.what == "reload" else "fetch")
        for t in schedule.step_transfers(plan, schedule.sizes_from_model(tiny_model(model_type).to(dtype), plan))
        if t.lane == "h2d" and t.what in ("fetch_fwd", "fetch_bwd", "fetch_rec", "reload")
    ]
    for s in trace["steps"]:
        got = [
            (t["stage_issued"], t["layer"], t["what"])
            for t in s["transfers"]
            if t["lane"] == "h2d" and t["what"] in ("fetch", "reload")
        ]
        assert sorted(got, key=lambda x: x[0]) == got, "issued out of stage order"
        # every fetch and reload is waited for by the compute that needs it, never before it was issued
        for t in s["transfers"]:
            if t["lane"] == "h2d" and t["what"] in ("fetch", "reload"):
                assert t["stage_issued"] <= t["stage_waited"], t
        # a reload is one copy per saved tensor of the layer (issued back to back), a fetch one copy per layer
        got = [g for k, g in enumerate(got) if g[2] == "fetch" or k == 0 or got[k - 1] != g]
        extra, missing = Counter(got) - Counter(expected), Counter(expected) - Counter(got)
        assert not extra and not missing, (
            f"{model_type}: issued (stage, layer, what) differ from the schedule: only in the trace {dict(extra)}, "
            f"only in the schedule {dict(missing)}\nplan:\n{plan.table()}"
        )
        # and in the same order inside each stage: the simulator queues them on its lanes in this order
        first = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        assert first is None, (
            f"{model_type}: issue order differs from step_transfers' from #{first}: trace {got[first : first + 6]}, "
            f"schedule {expected[first : first + 6]}\nplan:\n{plan.table()}"
        )


@pytest.mark.parametrize("stream_embeddings", [False, True])
def test_cost_model_bytes_are_the_models_up_to_padding(stream_embeddings):
    """`lazytrain plan`'s bytes_per_step (analytic cost model) against the exact one for a real model: the same
    transfers, weights differing only by the host store's 256-byte alignment of each parameter, and nothing counted
    twice when the embedding and head are streamed units."""
    from lazytrain_hf.planner import schedule
    from lazytrain_hf.planner.costmodel import CostModel

    model = tiny_model("qwen3", seed=1)
    kinds = models.layer_kinds(model.config)
    plan = keep_all_plan(kinds, stream_embeddings=stream_embeddings, loss_chunk_tokens=1024)
    cm = CostModel.from_config(model.config, "h800", plan.seq_len, plan.micro_batch_size, dtype_bytes=4)
    exact = schedule.bytes_per_step(plan, schedule.sizes_from_model(model, plan, device="cuda"))
    approx = schedule.bytes_per_step(plan, schedule.sizes_from_cost_model(cm, stream_embeddings))
    n_params = sum(1 for _ in model.parameters())
    assert approx["d2h"] == exact["d2h"]
    assert 0 <= exact["h2d"] - approx["h2d"] <= 2 * 256 * n_params, (exact, approx)
