"""LazyTrainer with streaming off is exactly Trainer."""

from __future__ import annotations

import torch
from conftest import tiny_model
from trainer_fixtures import LossRecorder, token_dataset
from transformers import Trainer, TrainingArguments

from lazytrain_hf import LazyTrainer, LazyTrainingArguments


def _run(trainer_cls, args_cls, tmp_path, **extra):
    model = tiny_model("qwen3", seed=1)
    args = args_cls(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=6, learning_rate=1e-3, logging_steps=1,
        report_to=[], seed=3, use_cpu=True, save_strategy="no", data_seed=3, **extra,
    )
    rec = LossRecorder()
    trainer = trainer_cls(model=model, args=args, train_dataset=token_dataset(), callbacks=[rec])
    trainer.train()
    return rec.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_streaming_off_matches_trainer(tmp_path):
    ref_losses, ref_state = _run(Trainer, TrainingArguments, tmp_path / "ref")
    losses, state = _run(LazyTrainer, LazyTrainingArguments, tmp_path / "lazy", stream_enabled=False)
    assert len(ref_losses) == 6
    assert losses == ref_losses, (losses, ref_losses)
    for k in ref_state:
        assert torch.equal(state[k], ref_state[k]), k


def test_plain_training_arguments_upgraded(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, learning_rate=5e-4)
    trainer = LazyTrainer(model=tiny_model("qwen3"), args=args, train_dataset=token_dataset(4))
    assert isinstance(trainer.args, LazyTrainingArguments)
    assert trainer.args.learning_rate == 5e-4
