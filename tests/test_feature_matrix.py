"""The Trainer feature matrix: each feature users switch on, trained with LazyTrainer (streaming on, the MILP's plan
on the CPU profile, the simulated asynchronous engine) against Trainer (LazyTrainer with ``stream_enabled=False``:
`transformers.Trainer` with the same HybridAdamW8bit optimizer). Compared: every logged training and evaluation
loss, and the files each run writes.

Tolerance: ``rel=2e-6`` on every logged loss (train, eval, predict). Streaming computes the same model with another
fp32 summation order (chunked cross entropy, per-layer gradient norms): measured differences are 0 to 2e-7 relative
over these 4 steps, while switching a feature off moves these losses by 1e-5 (weight decay) to 2e-1 (the MoE aux
loss), so a feature the streamed run ignored would fail. bf16 uses ``rel=1e-3``: the streamed run computes with bf16
weights (a bf16 compute copy of the fp32 model), Trainer with autocast's per-op casts of fp32 weights; the dtype
itself is checked in ``tests/test_trainer_features.py``. Files: the same set of paths under ``output_dir``, apart
from LazyTrain's own (the plan, its timeline, the fp32 masters, the measured profile).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import tiny_model
from trainer_fixtures import RUN_ARGS, token_dataset
from transformers import TrainerCallback

from lazytrain_hf import LazyTrainer, LazyTrainingArguments

LAZYTRAIN_FILES = ("lazytrain_plan.json", "lazytrain_timeline.png", "lazytrain_master.safetensors", "lazytrain_trace.json")


class Events(TrainerCallback):
    """Records which callback events fire, in order (the `callbacks` feature)."""

    def __init__(self):
        self.events: list[str] = []

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *a, **k: self.events.append(name)
        raise AttributeError(name)


FEATURES: dict[str, dict] = {
    "plain": {},
    "gradient_accumulation": dict(gradient_accumulation_steps=2),
    "label_smoothing": dict(label_smoothing_factor=0.1),
    "eval_predict": dict(eval_strategy="steps", eval_steps=2),
    "save_total_limit": dict(save_strategy="steps", save_steps=1, save_total_limit=2),
    "callbacks": dict(_callback=True),
    "report_to": dict(report_to="none"),
    "load_best_model_at_end": dict(
        eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, load_best_model_at_end=True
    ),
    "bf16": dict(bf16=True),
    "moe_router_aux_loss": dict(
        _model="qwen3_moe", _model_kw=dict(output_router_logits=True, router_aux_loss_coef=0.5)
    ),
    "peft_lora": dict(_peft="lora"),
    "peft_lora_on_lm_head": dict(_peft="lora_lm_head"),
    "peft_prompt_tuning": dict(_peft="prompt"),
    "resume_from_checkpoint": dict(_resume=True, save_strategy="steps", save_steps=2),
    "moe_resume_from_checkpoint": dict(_model="qwen3_moe", _resume=True, save_strategy="steps", save_steps=2),
    "max_grad_norm_off": dict(max_grad_norm=0.0),
    "weight_decay": dict(weight_decay=0.1),
}


def build_model(kw: dict):
    model = tiny_model(kw.get("_model", "qwen3"), seed=1, **kw.get("_model_kw", {}))
    peft = kw.get("_peft")
    if peft is None:
        return model
    from peft import LoraConfig, PromptTuningConfig, TaskType, get_peft_model

    torch.manual_seed(5)
    if peft == "prompt":
        cfg = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
    else:
        targets = ["q_proj", "v_proj"] + (["lm_head"] if peft == "lora_lm_head" else [])
        cfg = LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, target_modules=targets, lora_dropout=0.0)
    return get_peft_model(model, cfg)


def run(tmp_path, name: str, stream: bool) -> dict:
    kw = dict(FEATURES[name])
    events = Events() if kw.get("_callback") else None
    out = tmp_path / f"{name}-{'lazy' if stream else 'trainer'}"
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=4,
        learning_rate=5e-3,
        **RUN_ARGS,
        stream_enabled=stream,
        optim_hybrid_8bit=True,
        planner_hardware="cpu",
        planner_warmup_steps=1,
        planner_time_limit=10,
    )
    base.update({k: v for k, v in kw.items() if not k.startswith("_")})

    def trainer(**over) -> LazyTrainer:
        return LazyTrainer(
            model=build_model(kw),
            args=LazyTrainingArguments(**{**base, **over}),
            train_dataset=token_dataset(n=32),
            eval_dataset=token_dataset(n=8, seed=9),
            callbacks=[events] if events else None,
        )

    if kw.get("_resume"):  # 2 steps, then a fresh trainer resumes from checkpoint-2 to step 4
        trainer(max_steps=2).train()
        tr = trainer()
        tr.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    else:
        tr = trainer()
        tr.train()
    result = {
        "loss": [h["loss"] for h in tr.state.log_history if "loss" in h],
        "eval_loss": [h["eval_loss"] for h in tr.state.log_history if "eval_loss" in h],
        "files": sorted(
            os.path.relpath(os.path.join(r, f), out)
            for r, _, fs in os.walk(out)
            for f in fs
            if f not in LAZYTRAIN_FILES and not f.startswith("_lazytrain")
        ),
        "events": events.events if events else None,
        "best": tr.state.best_model_checkpoint and os.path.basename(tr.state.best_model_checkpoint),
    }
    if name == "eval_predict":
        pred = tr.predict(token_dataset(n=4, seed=11))
        result["predict_loss"] = [pred.metrics["test_loss"]]
    return result


RTOL = {"bf16": 1e-3}


@pytest.mark.parametrize("name", list(FEATURES))
def test_feature_matches_trainer(tmp_path, name):
    lazy, ref = run(tmp_path, name, stream=True), run(tmp_path, name, stream=False)
    rel = RTOL.get(name, 2e-6)
    assert len(lazy["loss"]) == len(ref["loss"]) == 4  # a resumed run's log history holds steps 1-2 too
    assert lazy["loss"] == pytest.approx(ref["loss"], rel=rel), (lazy["loss"], ref["loss"])
    assert lazy["eval_loss"] == pytest.approx(ref["eval_loss"], rel=rel), (lazy["eval_loss"], ref["eval_loss"])
    if "predict_loss" in ref:
        assert lazy["predict_loss"] == pytest.approx(ref["predict_loss"], rel=rel)
    assert lazy["files"] == ref["files"]
    assert lazy["events"] == ref["events"]
    assert lazy["best"] == ref["best"]
