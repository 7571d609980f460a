"""Trainer features while streaming behave as in `transformers.Trainer`: each test below is one row of the feature
table (router aux loss, PEFT adapters outside the decoder layers, the best model at the end, the optimizer across
train() calls, what push_to_hub uploads), checked against the unstreamed model or Trainer."""

from __future__ import annotations

import copy
import fnmatch
import os

import pytest
import torch
from conftest import tiny_model
from trainer_fixtures import RUN_ARGS, token_dataset
from transformers import TrainerCallback

from lazytrain_hf import LazyTrainer, LazyTrainingArguments, models
from lazytrain_hf.planner.plan import LayerPlan, Plan
from lazytrain_hf.streaming import attach


def batch(seed: int = 0, B: int = 2, T: int = 10) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def loss_and_grads(model, inputs, streamed: bool):
    model.zero_grad(set_to_none=True)
    if streamed:
        handle = attach(model, device="cpu")
        try:
            loss = handle.causal_lm_loss(model, inputs)
            loss.backward()
            grads = {k: v.clone() for k, v in handle.grads().items()}
        finally:
            handle.remove()
    else:
        loss = model(**inputs, use_cache=False).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_close_grads(got: dict, ref: dict, rtol: float, atol: float) -> None:
    assert sorted(got) == sorted(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=rtol, atol=atol, msg=k)


# ---------------------------------------------------------------------------------------------------------- MoE
@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text"])
def test_router_aux_loss_is_added_as_hf_does(model_type):
    """With `output_router_logits=True` the loss includes `router_aux_loss_coef * load_balancing_loss`, as the HF
    model's forward adds it; gradients (the routers' included) match within fp32 summation-order tolerance."""
    ref = tiny_model(model_type, seed=2, output_router_logits=True, router_aux_loss_coef=0.5)
    model = copy.deepcopy(ref)
    inputs = batch()
    ref_loss, ref_grads = loss_and_grads(ref, inputs, streamed=False)
    plain = tiny_model(model_type, seed=2, output_router_logits=False)
    no_aux = plain(**inputs, use_cache=False).loss.detach()
    assert abs(float(ref_loss - no_aux)) > 1e-3  # the aux term is visible at this coefficient
    loss, grads = loss_and_grads(model, inputs, streamed=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert_close_grads(grads, ref_grads, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------- PEFT
def _peft(model, kind: str):
    from peft import LoraConfig, PromptTuningConfig, TaskType, get_peft_model

    if kind == "prompt":
        cfg = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
    else:
        cfg = LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, target_modules=["q_proj", "lm_head"], lora_dropout=0.0)
    torch.manual_seed(3)
    return get_peft_model(model, cfg)


@pytest.mark.parametrize("kind", ["prompt", "lora_lm_head"])
def test_adapters_outside_the_layers_go_through_peft_forward(kind):
    """Prompt tuning (virtual tokens) and a LoRA on the lm_head are honoured: the streamed loss and the adapter's
    gradients equal the unstreamed PEFT model's."""
    ref = _peft(tiny_model("qwen3", seed=2), kind)
    model = copy.deepcopy(ref)
    inputs = batch()
    ref_loss, ref_grads = loss_and_grads(ref, inputs, streamed=False)
    loss, grads = loss_and_grads(model, inputs, streamed=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert ref_grads and sorted(grads) == sorted(ref_grads)
    assert any("lm_head" in k or "prompt" in k for k in ref_grads)
    assert_close_grads(grads, ref_grads, rtol=1e-4, atol=1e-6)


def test_prefix_tuning_is_refused():
    from peft import PrefixTuningConfig, TaskType, get_peft_model

    model = get_peft_model(tiny_model("qwen3"), PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4))
    with pytest.raises(ValueError, match="prefix tuning.*use LoRA or prompt tuning.*stream_enabled=False"):
        attach(model, device="cpu")


# ---------------------------------------------------------------------------------------------------------- Trainer
def resident_plan_file(tmp_path, kinds: list[str]) -> str:
    layers = [LayerPlan(index=i, kind=k, resident=i in (1, 2, 3)) for i, k in enumerate(kinds)]
    plan = Plan(layers=layers, micro_batch_size=4, seq_len=12, source="file", optimizer_overlap=False)
    path = str(tmp_path / "plan.json")
    plan.to_json(path)
    return path


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_best_model_is_exactly_the_best_checkpoint(tmp_path, model_type):
    """`load_best_model_at_end` with resident layers: every weight after train() is the best checkpoint's (as
    `from_pretrained` reads it; MoE checkpoints hold per-expert keys)."""
    from transformers import AutoModelForCausalLM

    model = tiny_model(model_type, seed=1)
    args = LazyTrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=5e-3,
        report_to=[],
        use_cpu=True,
        seed=3,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="first",
        greater_is_better=True,
        planner_plan=resident_plan_file(tmp_path, models.layer_kinds(model.config)),
    )
    evals = []

    def first_is_best(pred):  # the first checkpoint is the best: not the last step's weights
        evals.append(1)
        return {"first": -float(len(evals))}

    tr = LazyTrainer(
        model=model,
        args=args,
        train_dataset=token_dataset(),
        eval_dataset=token_dataset(n=4, seed=7),
        compute_metrics=first_is_best,
    )
    tr.train()
    best = tr.state.best_model_checkpoint
    assert best is not None and best.endswith("checkpoint-1"), best
    saved = AutoModelForCausalLM.from_pretrained(best).state_dict()
    state = model.state_dict()
    assert sorted(saved) == sorted(state)
    bad = [k for k in saved if not torch.equal(state[k], saved[k])]
    assert not bad, f"weights differ from {best}: {bad[:5]}"
    last = AutoModelForCausalLM.from_pretrained(os.path.join(os.path.dirname(best), "checkpoint-3")).state_dict()
    assert any(not torch.equal(last[k], saved[k]) for k in saved)  # the check can tell the two apart


def short_trainer(out, stream: bool, max_steps: int, **extra) -> tuple[list[float], LazyTrainer]:
    """A LazyTrainer (default plan, HybridAdamW8bit either way) and the list its logged losses are appended to."""
    losses: list[float] = []

    class Rec(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    args = LazyTrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=max_steps,
        learning_rate=5e-3,
        **RUN_ARGS,
        stream_enabled=stream,
        optim_hybrid_8bit=True,
        planner_policy="default",
        **extra,
    )
    tr = LazyTrainer(model=tiny_model("qwen3", seed=1), args=args, train_dataset=token_dataset(), callbacks=[Rec()])
    return losses, tr


def _two_trains(tmp_path, stream: bool) -> tuple[list[float], LazyTrainer]:
    losses, tr = short_trainer(tmp_path / f"out{stream}", stream, max_steps=2)
    tr.train()
    assert tr.optimizer is not None
    steps = [s["step"] for s in tr.optimizer.state.values()]
    assert steps and all(int(s) == 2 for s in steps)
    tr.train()
    steps = [s["step"] for s in tr.optimizer.state.values()]
    assert all(int(s) == 4 for s in steps), "the second train() started from fresh moments"
    return losses, tr


def test_optimizer_persists_and_a_second_train_continues(tmp_path):
    """As with Trainer: `trainer.optimizer` stays after train(), and a second train() continues from its moments;
    the streamed run's losses over both calls equal the unstreamed run's (same optimizer) within tolerance."""
    streamed, _ = _two_trains(tmp_path, stream=True)
    plain, _ = _two_trains(tmp_path, stream=False)
    assert len(streamed) == len(plain) == 4
    assert streamed == pytest.approx(plain, rel=1e-4)  # logged losses are rounded to 4 digits


class _RecordingHubApi:
    """The Hub client at the network boundary (unreachable here): records what would be uploaded."""

    def __init__(self):
        self.uploads: list[dict] = []

    def create_repo(self, repo_id, **kwargs):
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, folder_path, ignore_patterns=(), **kwargs):
        files = []
        for root, _, names in os.walk(folder_path):
            for n in names:
                rel = os.path.relpath(os.path.join(root, n), folder_path)
                if not any(
                    fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel.split(os.sep)[0], p) for p in ignore_patterns
                ):
                    files.append(rel)
        self.uploads.append(dict(kwargs, files=sorted(files)))


def test_push_to_hub_uploads_the_model_card_and_plan_not_the_machine(tmp_path, monkeypatch):
    import transformers.trainer

    api = _RecordingHubApi()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: api)
    args = LazyTrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        planner_hardware="auto",
        planner_warmup_steps=1,
        planner_time_limit=10,
        hub_model_id="me/tiny",
    )
    tr = LazyTrainer(model=tiny_model("qwen3", seed=1), args=args, train_dataset=token_dataset())
    tr.train()
    assert any("hardware" in n for n in os.listdir(tmp_path / "out"))  # the profile was measured and cached
    tr.push_to_hub()
    files = api.uploads[-1]["files"]
    for name in ("model.safetensors", "config.json", "README.md", "lazytrain_plan.json"):
        assert name in files, files
    assert not [f for f in files if "hardware" in f], files


def test_resume_restores_the_batch_size_the_plan_chose(tmp_path):
    """After `planner_auto_batch_size` picked a micro-batch size, resuming trains with that size again (not the
    per_device_train_batch_size given), so sampling and schedule continue exactly: losses equal the uninterrupted run."""
    from trainer_fixtures import make_trainer

    extra = dict(planner_auto_batch_size=True, planner_max_batch_size=2, per_device_train_batch_size=4)
    full = make_trainer(tmp_path / "full", max_steps=3, save_steps=1, **extra)
    full.train()
    chosen = full.lazy_plan.micro_batch_size
    assert chosen <= 2 and full.args.per_device_train_batch_size == chosen
    resumed = make_trainer(tmp_path / "full", max_steps=3, save_steps=1, **extra)
    assert resumed.args.per_device_train_batch_size == 4
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-1"))
    assert resumed.args.per_device_train_batch_size == chosen
    assert resumed.loss_recorder.losses == full.loss_recorder.losses[1:]


def _bf16_run(tmp_path, stream: bool, bf16: bool, look=None) -> tuple[list[float], LazyTrainer]:
    """Four steps; ``look(trainer)`` may return a callback that inspects the trainer while it trains."""
    losses, tr = short_trainer(tmp_path / f"out{stream}{bf16}", stream, max_steps=4, bf16=bf16)
    if look is not None:
        tr.add_callback(look(tr))
    tr.train()
    return losses, tr


def test_bf16_means_a_bf16_compute_copy_with_fp32_masters(tmp_path):
    """`bf16=True` on an fp32-loaded model: bf16 compute on the device (bf16 compute copy and resident weights),
    fp32 masters on the host, the model fp32 again after train() with the trained masters; losses follow Trainer's
    bf16 autocast run within 1e-3 relative over 4 steps (bf16 weights and residual stream vs autocast's per-op
    casts of fp32 weights) and are not the fp32 run's."""
    seen: dict = {}

    def look(tr):
        class Look(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                h = tr.stream_handle
                seen["compute"] = {e.dtype for ls in h.store.layers.values() for e in ls.entries}
                seen["master"] = {ls.master.dtype for ls in h.store.layers.values() if ls.master is not None}
                seen["resident"] = {p.dtype for _, p in h.resident_parameters()}

            def on_train_end(self, args, state, control, **kwargs):
                tr._updater.wait_all()
                seen["masters"] = {n: m.detach().clone() for n, m in tr._updater.named_masters()}

        return Look()

    bf16, tr = _bf16_run(tmp_path, stream=True, bf16=True, look=look)
    assert seen["compute"] == {torch.bfloat16} and seen["master"] == {torch.float32}
    assert seen["resident"] == {torch.bfloat16}
    params = dict(tr.model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}
    bad = [n for n, m in seen["masters"].items() if not torch.equal(params[n].detach(), m)]
    assert not bad, f"after train() these parameters are not their fp32 masters: {bad[:5]}"
    fp32, _ = _bf16_run(tmp_path, stream=True, bf16=False)
    autocast, _ = _bf16_run(tmp_path, stream=False, bf16=True)
    print("bf16 streamed", bf16, "Trainer bf16 autocast", autocast, "fp32 streamed", fp32)
    assert bf16 != fp32
    assert bf16 == pytest.approx(autocast, rel=1e-3), (bf16, autocast, fp32)


def test_plain_trainer_with_lazy_arguments_is_refused(tmp_path):
    """`transformers.Trainer(args=LazyTrainingArguments(...))` would train the unstreamed model with torch AdamW
    while the arguments say it streams: refused at construction, naming LazyTrainer; with streaming off it is the
    plain Trainer it always was."""
    from transformers import Trainer

    args = LazyTrainingArguments(output_dir=str(tmp_path / "a"), report_to=[], use_cpu=True)
    with pytest.raises(
        ValueError,
        match=r"Trainer\(args=LazyTrainingArguments\(stream_enabled=True\)\).*"
        r"lazytrain_hf\.LazyTrainer\(\.\.\.\).*stream_enabled=False",
    ):
        Trainer(model=tiny_model("qwen3"), args=args, train_dataset=token_dataset())
    off = LazyTrainingArguments(
        output_dir=str(tmp_path / "b"),
        report_to=[],
        use_cpu=True,
        stream_enabled=False,
        max_steps=1,
        save_strategy="no",
    )
    Trainer(model=tiny_model("qwen3"), args=off, train_dataset=token_dataset()).train()
    LazyTrainer(model=tiny_model("qwen3"), args=args, train_dataset=token_dataset())  # the right trainer: accepted


def test_sft_trainer_with_lazy_config_is_refused_and_sft_config_is_upgraded(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from lazytrain_hf import LazySFTConfig
    from lazytrain_hf.data import build_embedded_tokenizer

    tok = build_embedded_tokenizer(vocab_size=256, num_samples=300)
    rows = Dataset.from_list([{"prompt": f"What is {i} + 1?", "completion": f" {i + 1}"} for i in range(8)])
    cfg = LazySFTConfig(output_dir=str(tmp_path / "a"), report_to=[], use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match=r"lazytrain_hf\.LazySFTTrainer\(\.\.\.\)"):
        trl.SFTTrainer(
            model=tiny_model("qwen3", vocab_size=len(tok)), args=cfg, train_dataset=rows, processing_class=tok
        )
    plain = trl.SFTConfig(output_dir=str(tmp_path / "b"), report_to=[], use_cpu=True, bf16=False, max_length=64)
    tr = LazyTrainer(model=tiny_model("qwen3", vocab_size=len(tok)), args=plain, train_dataset=token_dataset())
    assert type(tr.args) is LazySFTConfig and tr.args.max_length == 64 and not tr.args.gradient_checkpointing


def test_hf_gradient_checkpointing_is_refused_while_streaming(tmp_path):
    with pytest.raises(ValueError, match=r"gradient_checkpointing=True.*recomputes.*stream_enabled=False"):
        LazyTrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True, report_to=[])
    LazyTrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True, stream_enabled=False, report_to=[])
