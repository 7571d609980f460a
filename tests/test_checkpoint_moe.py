"""MoE checkpoints round-trip bit-exactly: transformers 5 MoE models hold their experts fused
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) but `save_pretrained` writes one tensor per expert; a resume
converts them back (Note: [Checkpoint weights in the saved format] in lazytrain_hf/training/checkpoints.py), and a
checkpoint whose weights do not cover the model is refused by name."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from trainer_fixtures import make_trainer
from transformers import AutoModelForCausalLM

from lazytrain_hf.training.checkpoints import MASTER_FILE, verify_checkpoint

MOE_FAMILIES = ["qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text"]


def _trainer(out, model_type: str, stream: bool = True, bf16: bool = False, **kw):
    tr = make_trainer(
        out, max_steps=2, save_steps=1, model_type=model_type, stream=stream, planner_policy="default", **kw
    )
    if bf16:
        tr.model.to(torch.bfloat16)
    return tr


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    wa, wb = a.state_dict(), b.state_dict()
    assert wa.keys() == wb.keys()
    bad = [k for k in wa if not torch.equal(wa[k], wb[k])]
    detail = [f"{k}: max |diff| {(wa[k].float() - wb[k].float()).abs().max().item():.3g}" for k in bad[:5]]
    assert not bad, f"{len(bad)} of {len(wa)} tensors differ, first: {detail}"


def _resume_matches_uninterrupted(tmp_path, model_type: str, stream: bool, bf16: bool = False):
    full = _trainer(tmp_path / "full", model_type, stream, bf16)
    full.train()
    ckpt = tmp_path / "full" / "checkpoint-1"
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    # the checkpoint is in the saved (per-expert) format, not the model's fused one: the resume must convert
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys, sorted(keys)[:10]
    assert "model.layers.0.mlp.experts.gate_up_proj" in full.model.state_dict()

    resumed = _trainer(tmp_path / "resumed", model_type, stream, bf16)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 2
    assert resumed.loss_recorder.losses == full.loss_recorder.losses[1:]
    _assert_same_weights(full.model, resumed.model)
    # the checkpoint directory still loads with from_pretrained (which converts on its own), to the same weights
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "resumed" / "checkpoint-2"), dtype=full.model.dtype)
    _assert_same_weights(full.model, reloaded)
    return full, resumed


@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_moe_resume_is_bit_exact_streamed(tmp_path, model_type):
    full, resumed = _resume_matches_uninterrupted(tmp_path, model_type, stream=True)  # asserts losses and weights
    assert resumed.loss_recorder.losses == full.loss_recorder.losses[1:]


def test_moe_resume_is_bit_exact_unstreamed(tmp_path):
    """`stream_enabled=False` is Trainer's own loop, whose `_load_from_checkpoint` shares the defect."""
    full, resumed = _resume_matches_uninterrupted(tmp_path, "qwen3_moe", stream=False)  # asserts losses and weights
    assert resumed.loss_recorder.losses == full.loss_recorder.losses[1:]


def test_moe_resume_bf16_restores_fused_masters(tmp_path):
    """With a bf16 compute copy the fp32 masters travel in MASTER_FILE under the model's (fused) names."""
    full, _ = _resume_matches_uninterrupted(tmp_path, "qwen3_moe", stream=True, bf16=True)
    masters = load_file(str(tmp_path / "full" / "checkpoint-1" / MASTER_FILE))
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    assert fused in masters and masters[fused].dtype == torch.float32
    assert masters[fused].shape == full.model.state_dict()[fused].shape


@pytest.mark.parametrize(
    "removed", ["model.layers.1.mlp.experts.2.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
)
@pytest.mark.parametrize("stream", [True, False])
def test_checkpoint_missing_a_weight_is_refused(tmp_path, removed, stream):
    tr = make_trainer(
        tmp_path, max_steps=1, save_steps=1, model_type="qwen3_moe", stream=stream, planner_policy="default"
    )
    tr.train()
    ckpt = tmp_path / "checkpoint-1"
    weights = str(ckpt / "model.safetensors")
    tensors = load_file(weights)
    assert removed in tensors
    del tensors[removed]
    save_file(tensors, weights, metadata={"format": "pt"})

    again = make_trainer(tmp_path, max_steps=2, model_type="qwen3_moe", stream=stream, planner_policy="default")
    with pytest.raises(ValueError) as err:
        again.train(resume_from_checkpoint=str(ckpt))
    msg = str(err.value)
    assert str(ckpt) in msg and removed in msg and "resume from a checkpoint of this model" in msg, msg
    assert again.state.global_step == 0

    with pytest.raises(ValueError) as err:
        verify_checkpoint(str(ckpt), again.model)
    msg = str(err.value)
    assert str(ckpt) in msg and removed in msg, msg
    verify_checkpoint(str(ckpt))  # without the model only the files are checked: they are intact
    assert os.path.exists(weights)
