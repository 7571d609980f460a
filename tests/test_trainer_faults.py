"""Bad input and faults at the trainer level: refused before allocation, or recovered, with nothing lost."""

from __future__ import annotations

import errno
import os
import warnings

import pytest
import torch
from conftest import tiny_model
from trainer_fixtures import make_trainer

NVME_KW = dict(planner_policy="milp", planner_gpu_budget=600_000, activation_tiers=["gpu", "nvme"])


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_host_memory_refused_before_allocation(tmp_path, monkeypatch):
    import lazytrain_hf.training.planning as lt

    tr = make_trainer(tmp_path, max_steps=2, planner_policy="default")
    before = _weights(tr.model)
    monkeypatch.setattr(lt, "_available_host_bytes", lambda: 10_000)
    with pytest.raises(ValueError) as e:
        tr.train()
    msg = str(e.value)
    assert "host memory" in msg and "10000 bytes" in msg and "optimizer state" in msg
    assert "batch 1 does not fit" in msg or "per_device_train_batch_size <=" in msg
    assert tr.stream_handle is None
    layer = tr.model.model.layers[0]
    assert not layer._forward_pre_hooks  # nothing was attached
    after = _weights(tr.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_host_memory_suggests_a_batch_that_fits(tmp_path, monkeypatch):
    import lazytrain_hf.training.planning as lt
    from lazytrain_hf.planner.plan import Plan

    tr = make_trainer(tmp_path, max_steps=1, planner_policy="default")
    plan = Plan.default(4, micro_batch_size=8)
    plan.predicted["pinned_host_bytes"] = 8 * 1_000_000  # 1 MB per sequence
    monkeypatch.setattr(lt, "host_reserve_bytes", lambda: 0)
    fp = lt.host_footprint(plan, tr.model, hybrid_8bit=True, args=tr.args)
    fixed = max(fp.total, fp.save_peak) - fp.activations  # every term but the pinned activations
    monkeypatch.setattr(lt, "_available_host_bytes", lambda: fixed + 3_500_000)
    with pytest.raises(ValueError, match=r"per_device_train_batch_size <= 3 fits"):
        tr.check_host_memory(plan)
    monkeypatch.setattr(lt, "_available_host_bytes", lambda: fixed + 8_000_000)
    tr.check_host_memory(plan)  # exactly fits


def test_nvme_dir_missing_is_named(tmp_path):
    """Refused when the arguments are built (LazyTrainingArguments checks the directory), before any trainer."""
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(ValueError, match=f"activation_nvme_dir=.*{missing}.*mkdir -p"):
        make_trainer(tmp_path / "run", max_steps=1, activation_nvme_dir=str(missing), **NVME_KW)


def test_nvme_disk_full_during_a_step(tmp_path, monkeypatch):
    """ENOSPC while spilling: a clear error naming the directory and bytes, the step never applied (weights and
    optimizer state as after the last good step), spill files removed."""
    import lazytrain_hf.activations.nvme as act

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    tr = make_trainer(tmp_path / "run", max_steps=3, activation_nvme_dir=str(nvme), **NVME_KW)
    real = act._pwrite
    state = {"armed": False}

    def full_disk(fd, data, offset):
        if state["armed"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(act, "_pwrite", full_disk)
    snap = {}
    from transformers import TrainerCallback

    class ArmAfterFirstStep(TrainerCallback):
        def on_step_end(self, args, state_, control, **kw):
            if state_.global_step == 1:
                snap["w"] = _weights(tr.model)
                state["armed"] = True

    tr.add_callback(ArmAfterFirstStep())
    with pytest.raises(OSError) as e:
        tr.train()
    assert "nvme" in tr.lazy_plan.tiers_used()
    msg = str(e.value)
    assert e.value.errno == errno.ENOSPC and str(nvme) in msg and "bytes" in msg
    after = _weights(tr.model)
    assert all(torch.equal(snap["w"][k], after[k]) for k in after), "a failed step changed the weights"
    leftovers = [f for _, _, files in os.walk(nvme) for f in files]
    assert leftovers == []


def test_solver_failure_falls_back_to_heuristic_and_trains(tmp_path, monkeypatch):
    import lazytrain_hf.planner.milp as milp

    def broken_solve(*args, **kwargs):
        return {"status": "error", "has_solution": False, "solver_result": "solver crashed", "gap": None,
                "seconds": 0.0, "name": "broken", "objective": None}

    monkeypatch.setattr(milp, "run_solver", broken_solve)
    tr = make_trainer(tmp_path, max_steps=2, planner_policy="milp", planner_gpu_budget=400_000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.train()
    assert tr.lazy_plan.source == "heuristic"
    assert any("heuristic" in str(w.message) for w in caught)
    assert len(tr.loss_recorder.losses) == 2


def test_unknown_attention_implementation_is_refused(tmp_path):
    tr = make_trainer(tmp_path, max_steps=1, planner_policy="milp")
    tr.model.config._attn_implementation = "paged_turbo_attention"
    with pytest.raises(ValueError) as e:
        tr.train()
    msg = str(e.value)
    assert "paged_turbo_attention" in msg and "sdpa" in msg and "eager" in msg


def test_unsupported_model_type_refused_at_construction(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from lazytrain_hf import LazyTrainer, LazyTrainingArguments

    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, num_hidden_layers=2, vocab_size=64)
    with pytest.raises(ValueError, match="supported model types are .*qwen3"):
        LazyTrainer(model=AutoModelForCausalLM.from_config(cfg),
                    args=LazyTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True))
    # with streaming off it is plain Trainer and accepts any model
    LazyTrainer(model=tiny_model("qwen3"), args=LazyTrainingArguments(output_dir=str(tmp_path), report_to=[],
                                                                     use_cpu=True, stream_enabled=False))


def test_nvme_dir_not_writable_is_named(tmp_path, monkeypatch):
    """Simulated: tests run as root, which writes through permission bits, so `os.access` is made to say no."""
    import lazytrain_hf.activations.nvme as act

    nvme = tmp_path / "ro"
    nvme.mkdir()
    monkeypatch.setattr(act.os, "access", lambda path, mode: not str(path).startswith(str(nvme)))
    with pytest.raises(ValueError, match="not writable") as e:
        make_trainer(tmp_path / "run", max_steps=1, activation_nvme_dir=str(nvme), **NVME_KW)
    assert str(nvme) in str(e.value)


def test_given_optimizer_refused_when_streaming(tmp_path):
    """A user optimizer would never update the streamed layers (they are updated through the host masters)."""
    tr = make_trainer(tmp_path, max_steps=1, planner_policy="default")
    tr.optimizer = torch.optim.SGD(tr.model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizers=.*stream_enabled=False"):
        tr.train()
    assert tr.stream_handle is None and not tr.model.model.layers[0]._forward_pre_hooks


def test_train_twice_keeps_the_optimizer(tmp_path):
    """As with Trainer, the optimizer outlives train(); the second train() builds a new host store and continues
    from the optimizer's state (tests/test_trainer_features.py compares the losses with Trainer's)."""
    tr = make_trainer(tmp_path, max_steps=2, planner_policy="default")
    tr.train()
    assert tr.optimizer is not None
    tr.train()
    assert len(tr.loss_recorder.losses) == 4
