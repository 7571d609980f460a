"""The CUDA path's copies and host synchronisations, checked on the CPU through what they change there.

- Gradient norms: one pass per layer and optimizer step, on the last micro-batch only (Note: [Squared norms of
  accumulated gradients] in lazytrain_hf/streaming/gradients.py), with the logged norms equal to Trainer's.
- Prefetches never wait for the overlapped optimizer (Note: [A prefetch never waits for the optimizer] in
  lazytrain_hf/streaming/scheduler.py): deferred while their layer updates, values bit-exact.
- Resident gradients cross asynchronously and resident parameters are uploaded from staging on the H2D lane (Notes:
  [Resident gradients cross asynchronously], [Resident parameters are uploaded from pinned staging] in
  lazytrain_hf/training/updater.py): bit-exact with the synchronous engine, and the training thread does not block on
  them when the optimizer overlaps.

Everything runs under the simulated asynchronous engine (copies and updates land late, destinations poisoned
meanwhile), so a missing wait shows as a wrong value.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import tiny_model
from test_plan_space import assert_bit_exact, keep_all_plan, reference, train_plan
from trainer_fixtures import make_trainer
from transformers import TrainerCallback

from lazytrain_hf import models
from lazytrain_hf.streams import MAX_DELAY_ENV
from lazytrain_hf.training.updater import LayerwiseUpdater


class _HandleProbe(TrainerCallback):
    """Reads the executor's norm counters after every optimizer step."""

    def __init__(self):
        self.trainer = None
        self.per_step: list[tuple[int, int]] = []
        self._last = (0, 0)

    def on_step_end(self, args, state, control, **kwargs):
        h = self.trainer.stream_handle
        if h is None:  # the plain Trainer run
            return
        h.synchronize()
        now = (h.host_norm_passes, h.device_norm_passes)
        self.per_step.append((now[0] - self._last[0], now[1] - self._last[1]))
        self._last = now


def _grad_norm_run(tmp_path, name: str, ga: int, stream: bool):
    trainer = make_trainer(
        tmp_path / name,
        max_steps=2,
        stream=stream,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ga,
        planner_policy="keep_all",
        max_grad_norm=0.5,
    )
    probe = _HandleProbe()
    probe.trainer = trainer
    trainer.add_callback(probe)
    trainer.train()
    norms = [log["grad_norm"] for log in trainer.loss_recorder.logs]
    return norms, probe.per_step


@pytest.mark.parametrize("ga", [3, 1])
def test_one_host_norm_pass_per_layer_and_step(tmp_path, ga):
    """GA=3: one host norm pass per layer and step (the last micro-batch's, after its addition), none on the device
    (before: a host pass on micro-batches 2 and 3 and a device pass on micro-batch 1). GA=1: one device pass per
    layer and step. The logged gradient norms (clipping at 0.5 is active) equal Trainer's within rel 2e-6."""
    norms, per_step = _grad_norm_run(tmp_path, f"stream{ga}", ga, stream=True)
    ref_norms, _ = _grad_norm_run(tmp_path, f"plain{ga}", ga, stream=False)
    layers = tiny_model("qwen3").config.num_hidden_layers
    expected = (layers, 0) if ga > 1 else (0, layers)
    assert per_step == [expected, expected], per_step
    assert len(norms) == len(ref_norms) == 2
    assert norms == pytest.approx(ref_norms, rel=2e-6), (norms, ref_norms)
    assert min(norms) > 0.5  # the clip coefficient was in play


def test_prefetch_deferred_while_layer_updates(async_engine, monkeypatch):
    """A slow overlapped optimizer: prefetches of layers still updating are deferred (counted), urgent fetches wait,
    and every loss, weight and master is bit-exact with the run without overlap on the synchronous engine."""
    kinds = models.layer_kinds(tiny_model("qwen3").config)
    ref = reference("qwen3", False, 1024, 1, torch.float32)
    plan = keep_all_plan(kinds, False, 1024)
    plan.optimizer_overlap = True
    for lp in plan.layers:
        lp.fetch_fwd_ahead = 2
    not_ready: list[int] = []
    blocked: list[int] = []
    real_update, real_ready = LayerwiseUpdater._update, LayerwiseUpdater.layer_updated
    real_wait = LayerwiseUpdater.wait_layer

    def slow_update(self, *a, **k):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.02)  # the update of every layer lags far behind the next forward
        return real_update(self, *a, **k)

    def counting_ready(self, i):
        ok = real_ready(self, i)
        if not ok:
            not_ready.append(i)
        return ok

    def counting_wait(self, i):
        if not real_ready(self, i):
            blocked.append(i)
        return real_wait(self, i)

    monkeypatch.setattr(LayerwiseUpdater, "_update", slow_update)
    monkeypatch.setattr(LayerwiseUpdater, "layer_updated", counting_ready)
    monkeypatch.setattr(LayerwiseUpdater, "wait_layer", counting_wait)
    got = train_plan("qwen3", plan, 1, torch.float32, simulate=True)
    assert_bit_exact(got, ref, "optimizer overlap with a slow optimizer, prefetch depth 2")
    assert not_ready, "no prefetch met a layer still updating: the test did not exercise the deferral"
    assert blocked, "no urgent fetch had to wait for its layer's update"


@pytest.mark.parametrize("overlap", [True, False])
def test_resident_grads_async_bit_exact(async_engine, monkeypatch, overlap):
    """bf16 model, embeddings / final norm / lm_head resident: their gradients cross on the simulated D2H lane (late,
    staging poisoned until they land) and are waited for by the update; their updated values cross on the H2D lane
    (the parameter poisoned until the copy lands) and the next forward waits for them; bit-exact with the
    synchronous engine. With overlap the training thread never blocks on them (no such host synchronisation in
    the trace); without, once per step."""
    monkeypatch.setenv(MAX_DELAY_ENV, "0.02")
    kinds = models.layer_kinds(tiny_model("qwen3").config)
    ref = reference("qwen3", False, 1024, 2, torch.bfloat16)
    plan = keep_all_plan(kinds, False, 1024)
    plan.optimizer_overlap = overlap
    issued: list[str] = []
    traces = []
    real_d2h = LayerwiseUpdater._resident_grad_d2h

    def counting_d2h(self, name, g, master):
        pending = real_d2h(self, name, g, master)
        if pending is not None:
            issued.append(name)
            if not traces:
                traces.append(self.handle.trace)
        return pending

    monkeypatch.setattr(LayerwiseUpdater, "_resident_grad_d2h", counting_d2h)
    got = train_plan("qwen3", plan, 2, torch.bfloat16, simulate=True)
    assert_bit_exact(got, ref, f"bf16, resident gradients asynchronous, overlap={overlap}")
    assert len(issued) >= 3 * 3, issued  # embed, final norm, lm_head, each of the 3 steps
    blocked = [s["sync_reasons"].get("resident gradient D2H", 0) for s in traces[0].steps]
    assert len(blocked) == 3, blocked
    if overlap:
        assert not any(blocked), blocked
    else:
        assert all(blocked), blocked
