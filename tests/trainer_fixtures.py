"""Small LazyTrainer set-ups shared by the trainer tests and their subprocess helpers."""

from __future__ import annotations

import torch
from conftest import tiny_model
from datasets import Dataset
from transformers import TrainerCallback

from lazytrain_hf import LazyTrainer, LazyTrainingArguments

# The run settings every Trainer-vs-LazyTrainer comparison shares: a loss logged each step, no reporting and no
# saving, the CPU, and one seed for the model's training and for the data order.
RUN_ARGS = dict(logging_steps=1, report_to=[], use_cpu=True, seed=3, data_seed=3, save_strategy="no")


class LossRecorder(TrainerCallback):
    def __init__(self):
        self.losses: list[float] = []
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])
            self.logs.append(dict(logs))


def token_dataset(n: int = 16, T: int = 12, vocab: int = 128, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, T), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def make_trainer(out: str, max_steps: int = 4, save_steps: int | None = None, stream: bool = True,
                 model_type: str = "qwen3", seed: int = 3, **extra) -> LazyTrainer:
    model = tiny_model(model_type, seed=1)
    kw = dict(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=max_steps, learning_rate=1e-3,
        logging_steps=1, report_to=[], seed=seed, data_seed=seed, use_cpu=True, stream_enabled=stream,
        planner_hardware="cpu", planner_warmup_steps=1, planner_time_limit=10,
        save_strategy="steps" if save_steps else "no",
    )
    if save_steps:
        kw["save_steps"] = save_steps
    kw.update(extra)
    args = LazyTrainingArguments(**kw)
    rec = LossRecorder()
    trainer = LazyTrainer(model=model, args=args, train_dataset=token_dataset(), callbacks=[rec])
    trainer.loss_recorder = rec
    return trainer
