"""`LazyTrainer(Trainer)`: plan at `train()` start, stream layers through hooks, Hybrid 8-bit optimizer."""

from __future__ import annotations

from typing import Any

from transformers import Trainer, TrainingArguments

from .args import LazyTrainingArguments


class LazyTrainer(Trainer):
    """A `transformers.Trainer` that trains models larger than the GPU.

    With `args.stream_enabled=False` it is exactly `Trainer`. A plain `TrainingArguments` is upgraded to
    `LazyTrainingArguments` (every field it set is kept, LazyTrain fields take their defaults).
    """

    def __init__(self, model: Any = None, args: TrainingArguments | None = None, **kwargs: Any):
        # Phase 1: arguments. A plain TrainingArguments is upgraded, not rejected.
        if args is None:
            args = LazyTrainingArguments(output_dir="trainer_output")
        elif not isinstance(args, LazyTrainingArguments):
            args = LazyTrainingArguments.from_training_arguments(args)
        super().__init__(model=model, args=args, **kwargs)
