"""The Trainer contract as data: every `TrainingArguments` field and every `Trainer.__init__` argument, classified.

Each row is one of:

- ``same(run)``: LazyTrainer (streaming on) trains as `transformers.Trainer` does with it: ``run`` names a short
  training (`RUNS`) that sets it and is compared against Trainer. Fields Trainer alone handles (logging, saving,
  evaluation scheduling, reporting) share one representative run per concern; fields that change the math get their
  own run.
- ``refused(setting, pattern, where)``: refused with an error naming the option, the value and the fix; ``setting``
  triggers it (arguments, or ``_init`` keys for `LazyTrainer(...)` arguments), ``pattern`` is matched against the
  message, ``where`` is when: ``"args"`` (`LazyTrainingArguments(...)`), ``"init"`` (`LazyTrainer(...)`) or
  ``"train"`` (`train()`).
- ``na(reason)``: nothing to compare in one process on this machine (the reason says why and where it is covered).

`tests/test_trainer_contract.py` derives the field list from `dataclasses.fields(TrainingArguments)` and the
argument list from `inspect.signature(Trainer.__init__)`: a field transformers adds fails the test until it is
classified here.

Rows another change owns (issue #28 part A: model_init, the optimizer paths, torch_compile) carry the outcome that
change intends, in `CONTRACT_A`; with ``CONTRACT_A_MERGED = False`` their checks are expected to fail (xfail) on a
branch without it. Flip it (or edit a row) when merging.
"""

from __future__ import annotations

from typing import Any, NamedTuple

CONTRACT_A_MERGED = True


class Row(NamedTuple):
    verdict: str  # "same" | "refused" | "n/a"
    run: str | None = None  # same: the key of RUNS
    setting: dict[str, Any] | None = None  # refused: what triggers it
    pattern: str | None = None  # refused: regex the message must match
    where: str | None = None  # refused: "args" | "init" | "train"
    reason: str | None = None  # n/a: why
    owner: str = "b"  # "a": issue #28 part A decides (CONTRACT_A)


def same(run: str, owner: str = "b") -> Row:
    return Row("same", run=run, owner=owner)


def refused(setting: dict[str, Any], pattern: str, where: str = "args", owner: str = "b") -> Row:
    return Row("refused", setting=setting, pattern=pattern, where=where, owner=owner)


def na(reason: str) -> Row:
    return Row("n/a", reason=reason)


# Settings of the short trainings the `same` rows point at (merged over the base arguments of the test). Keys
# starting with "_" are the test's own: _eval (an eval set), _metrics (compute_metrics and
# preprocess_logits_for_metrics), _callbacks (a recording callback), _collator (a padding collator over rows of
# several lengths), _loss_func (compute_loss_func), _tokenizer (processing_class), _files (compare the files written),
# _bf16 (bf16 tolerance), _model_init (model_init instead of model), _model (another model: a forward wrapper or
# override, a MoE with the router aux loss, another head), _freeze (layers 0-1 frozen, checked bit-identical),
# _iterable (an IterableDataset), _clamp (a callback clamping the weights in place after every step).
RUNS: dict[str, dict[str, Any]] = {
    "base": {},
    "epochs": dict(max_steps=-1, num_train_epochs=2),
    "learning_rate": dict(learning_rate=3e-3),
    "scheduler": dict(lr_scheduler_type="cosine_with_restarts", lr_scheduler_kwargs={"num_cycles": 2}),
    "warmup": dict(warmup_steps=2),
    "weight_decay": dict(weight_decay=0.1),
    "adam": dict(adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6),
    "grad_accum": dict(gradient_accumulation_steps=2),
    "tokens_across_devices": dict(gradient_accumulation_steps=2, average_tokens_across_devices=False, _collator=True),
    "clip": dict(max_grad_norm=0.05),
    "label_smoothing": dict(label_smoothing_factor=0.1),
    "bf16": dict(bf16=True, _bf16=True),
    "neftune": dict(neftune_noise_alpha=5.0),
    "batch_size": dict(per_device_train_batch_size=2),
    "seed": dict(seed=11, data_seed=12),
    "determinism": dict(full_determinism=True),
    "sampling": dict(train_sampling_strategy="sequential"),
    "drop_last": dict(dataloader_drop_last=True, per_device_train_batch_size=5),
    "logging": dict(
        logging_strategy="steps",
        logging_steps=2,
        logging_first_step=True,
        logging_nan_inf_filter=False,
        log_on_each_node=False,
        include_num_input_tokens_seen="all",
        log_level="info",
        log_level_replica="error",
        disable_tqdm=True,
        run_name="contract",
        skip_memory_metrics=False,
        report_to="none",
        _callbacks=True,
    ),
    "eval": dict(
        eval_strategy="steps",
        eval_steps=2,
        eval_delay=1,
        eval_on_start=True,
        per_device_eval_batch_size=3,
        prediction_loss_only=True,
        eval_accumulation_steps=1,
        eval_use_gather_object=True,
        _eval=True,
    ),
    "metrics": dict(
        eval_strategy="steps",
        eval_steps=2,
        include_for_metrics=["inputs", "loss"],
        batch_eval_metrics=False,
        eval_do_concat_batches=True,
        _eval=True,
        _metrics=True,
    ),
    "save": dict(
        save_strategy="steps",
        save_steps=1,
        save_total_limit=2,
        save_on_each_node=False,
        save_only_model=False,
        enable_jit_checkpoint=True,
        _tokenizer=True,
        _files=True,
    ),
    "resume": dict(
        save_strategy="steps",
        save_steps=2,
        save_only_model=False,
        ignore_data_skip=False,
        restore_callback_states_from_checkpoint=True,
        _resume=True,
    ),
    "best_model": dict(
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
        _eval=True,
    ),
    "dataloader": dict(
        dataloader_pin_memory=False,
        dataloader_in_order=False,
        remove_unused_columns=False,
        label_names=["labels"],
        accelerator_config={"split_batches": False, "even_batches": True, "use_seedable_sampler": True},
        _collator=True,
    ),
    "housekeeping": dict(
        use_cache=True,
        torch_empty_cache_steps=1,
        auto_find_batch_size=True,
        debug="underflow_overflow",
    ),
    "loss_func": dict(_loss_func=True),
    "model_init": dict(_model_init=True),
    # what the user hands in as the model, the data or a callback (INPUTS)
    "forward_wrapper": dict(_model="forward_wrapper"),
    "forward_override": dict(_model="forward_override"),
    "frozen_bf16": dict(bf16=True, _bf16=True, _freeze=True),
    "iterable": dict(_iterable=True),
    "clamp": dict(_clamp=True),
    "moe": dict(gradient_accumulation_steps=2, _model="moe"),
}

# Which runs are part of the default (fast) test run; the others are marked slow.
FAST_RUNS = {
    "base",
    "grad_accum",
    "clip",
    "bf16",
    "label_smoothing",
    "logging",
    "eval",
    "save",
    "best_model",
    "loss_func",
    "clamp",
}

_DDP = "a DistributedDataParallel wrapper setting; the executor does not use the wrapper (it all-reduces per layer, "
_DDP += "tests/test_trainer_ddp.py) and Qwen's buffers are constant, so there is nothing it changes"
_HUB = "uploads to the Hugging Face Hub (offline here); what is uploaded is save_model's output, row `save`"
_WORKERS = "only with dataloader_num_workers > 0 (worker processes; the issue's trials found them equal)"

FIELDS: dict[str, Row] = {
    # ---- what is trained and how long
    "output_dir": same("base"),
    "per_device_train_batch_size": same("batch_size"),
    "num_train_epochs": same("epochs"),
    "max_steps": same("base"),
    "learning_rate": same("learning_rate"),
    "lr_scheduler_type": same("scheduler"),
    "lr_scheduler_kwargs": same("scheduler"),
    "warmup_steps": same("warmup"),
    # ---- optimizer
    "optim": refused({"optim": "adamw_torch"}, r"optim='adamw_torch' with stream_enabled=True.*stream_enabled=False"),
    "optim_args": refused(
        {"optim_args": "foo=1"}, r"optim_args='foo=1' with stream_enabled=True.*stream_enabled=False"
    ),
    "weight_decay": same("weight_decay"),
    "adam_beta1": same("adam"),
    "adam_beta2": same("adam"),
    "adam_epsilon": same("adam"),
    "optim_target_modules": na(
        "read only by the GaLore / APOLLO / LOMO optimizers that `optim` selects, which streaming refuses (row optim)"
    ),
    "gradient_accumulation_steps": same("grad_accum"),
    "average_tokens_across_devices": same("tokens_across_devices"),
    "max_grad_norm": same("clip"),
    "label_smoothing_factor": same("label_smoothing"),
    # ---- precision and memory
    "bf16": same("bf16"),
    "fp16": refused({"fp16": True}, r"fp16=True with stream_enabled=True.*bf16=True.*stream_enabled=False"),
    "bf16_full_eval": refused(
        {"bf16_full_eval": True}, r"bf16_full_eval=True with stream_enabled=True.*bf16=True.*stream_enabled=False"
    ),
    "fp16_full_eval": refused(
        {"fp16_full_eval": True}, r"fp16_full_eval=True with stream_enabled=True.*bf16=True.*stream_enabled=False"
    ),
    "tf32": na("CUDA only (TrainingArguments refuses it without an Ampere GPU); a process-wide matmul setting"),
    "activation_checkpointing": refused(
        {"activation_checkpointing": True}, r"gradient_checkpointing=True.*stream_enabled=True.*recompute"
    ),
    "activation_checkpointing_kwargs": na("read only with activation_checkpointing, which streaming refuses"),
    "gradient_checkpointing": refused(
        {"gradient_checkpointing": True}, r"gradient_checkpointing=True.*stream_enabled=True.*recompute"
    ),
    "gradient_checkpointing_kwargs": na("read only with gradient_checkpointing, which streaming refuses"),
    "torch_compile": refused({"torch_compile": True}, r"torch_compile", owner="a"),
    "torch_compile_backend": refused({"torch_compile_backend": "inductor"}, r"torch_compile", owner="a"),
    "torch_compile_mode": refused({"torch_compile_mode": "default"}, r"torch_compile", owner="a"),
    "use_liger_kernel": refused(
        {"use_liger_kernel": True}, r"use_liger_kernel=True with stream_enabled=True.*stream_enabled=False"
    ),
    "liger_kernel_config": na("read only with use_liger_kernel, which streaming refuses"),
    "use_cache": same("housekeeping"),
    "neftune_noise_alpha": same("neftune"),
    "torch_empty_cache_steps": same("housekeeping"),
    "auto_find_batch_size": same("housekeeping"),
    # ---- logging and reporting
    "logging_strategy": same("logging"),
    "logging_steps": same("logging"),
    "logging_first_step": same("logging"),
    "log_on_each_node": same("logging"),
    "logging_nan_inf_filter": same("logging"),
    "include_num_input_tokens_seen": same("logging"),
    "log_level": same("logging"),
    "log_level_replica": same("logging"),
    "disable_tqdm": same("logging"),
    "report_to": same("logging"),
    "run_name": same("logging"),
    "project": na("read only by the trackio integration (not installed; it reports logs row `logging` compares)"),
    "trackio_space_id": na("read only by the trackio integration (not installed)"),
    "trackio_bucket_id": na("read only by the trackio integration (not installed)"),
    "trackio_static_space_id": na("read only by the trackio integration (not installed)"),
    "skip_memory_metrics": same("logging"),
    # ---- evaluation
    "eval_strategy": same("eval"),
    "eval_steps": same("eval"),
    "eval_delay": same("eval"),
    "per_device_eval_batch_size": same("eval"),
    "prediction_loss_only": same("eval"),
    "eval_on_start": same("eval"),
    "eval_do_concat_batches": same("metrics"),
    "eval_use_gather_object": same("eval"),
    "eval_accumulation_steps": same("eval"),
    "include_for_metrics": same("metrics"),
    "batch_eval_metrics": same("metrics"),
    # ---- saving, resuming, the best model
    "save_only_model": same("save"),
    "save_strategy": same("save"),
    "save_steps": same("save"),
    "save_on_each_node": same("save"),
    "save_total_limit": same("save"),
    "enable_jit_checkpoint": same("save"),
    "ignore_data_skip": same("resume"),
    "restore_callback_states_from_checkpoint": same("resume"),
    "resume_from_checkpoint": na(
        "not read by Trainer (example scripts pass it to train(resume_from_checkpoint=...), row resume)"
    ),
    "load_best_model_at_end": same("best_model"),
    "metric_for_best_model": same("best_model"),
    "greater_is_better": same("best_model"),
    "push_to_hub": na(_HUB),
    "hub_token": na(_HUB),
    "hub_private_repo": na(_HUB),
    "hub_model_id": na(_HUB),
    "hub_strategy": na(_HUB),
    "hub_always_push": na(_HUB),
    "hub_revision": na(_HUB),
    # ---- randomness and devices
    "full_determinism": same("determinism"),
    "seed": same("seed"),
    "data_seed": same("seed"),
    "use_cpu": same("base"),
    "accelerator_config": same("dataloader"),
    "parallelism_config": refused(
        {"parallelism_config": "_tp"}, r"parallelism_config=.* with stream_enabled=True.*stream_enabled=False"
    ),
    # ---- data loading
    "dataloader_drop_last": same("drop_last"),
    "dataloader_num_workers": na(_WORKERS),
    "dataloader_pin_memory": same("dataloader"),
    "dataloader_persistent_workers": na(_WORKERS),
    "dataloader_prefetch_factor": na(_WORKERS),
    "dataloader_multiprocessing_context": na(_WORKERS),
    "dataloader_in_order": same("dataloader"),
    "remove_unused_columns": same("dataloader"),
    "label_names": same("dataloader"),
    "train_sampling_strategy": same("sampling"),
    "length_column_name": na("read only with train_sampling_strategy='group_by_length' (the issue's trials: equal)"),
    # ---- distributed
    "ddp_find_unused_parameters": na(_DDP),
    "ddp_bucket_cap_mb": na(_DDP),
    "ddp_broadcast_buffers": na(_DDP),
    "ddp_static_graph": na(_DDP),
    "ddp_backend": na("the process group backend of a multi-process launch (tests/test_trainer_ddp.py)"),
    "ddp_timeout": na("the timeout of a multi-process launch: Trainer's default group and LazyTrainer's data-parallel "
                      "waits alike (tests/test_trainer_dp_checkpoints.py, test_timeout_follows_ddp_timeout)"),
    "fsdp": refused({"fsdp": "full_shard"}, r"fsdp='full_shard' with stream_enabled=True.*stream_enabled=False"),
    "fsdp_config": na("read only with fsdp, which streaming refuses"),
    "deepspeed": refused(
        {"deepspeed": {"zero_optimization": {"stage": 2}}},
        r"deepspeed=.* with stream_enabled=True.*stream_enabled=False",
    ),
    "debug": same("housekeeping"),
    "local_rank": na("set by the launcher (torchrun / accelerate launch); tests/test_trainer_ddp.py"),
    # ---- not read by Trainer
    "do_train": na("not read by Trainer (a flag for example scripts)"),
    "do_eval": na("not read by Trainer (a flag for example scripts)"),
    "do_predict": na("not read by Trainer (a flag for example scripts)"),
}

INIT_ARGS: dict[str, Row] = {
    "model": same("base"),
    "args": same("base"),
    "data_collator": same("dataloader"),
    "train_dataset": same("base"),
    "eval_dataset": same("eval"),
    "processing_class": same("save"),
    "model_init": same("model_init", owner="a"),
    "compute_loss_func": same("loss_func"),
    "compute_metrics": same("metrics"),
    "callbacks": same("logging"),
    "optimizers": refused(
        {"_init": "optimizers"}, r"optimizers.*stream_enabled=True.*stream_enabled=False", "train", owner="a"
    ),
    "optimizer_cls_and_kwargs": refused(
        {"_init": "optimizer_cls_and_kwargs"}, r"optimizer_cls_and_kwargs.*stream_enabled", "init", owner="a"
    ),
    "preprocess_logits_for_metrics": same("metrics"),
}

# What the user hands Trainer besides arguments: kinds of models, data and callbacks (issue #28's rows), each with the
# run that trains it against Trainer or the refusal it gets.
INPUTS: dict[str, Row] = {
    "variable_length_rows": same("dataloader"),
    "callback_edits_weights": same("clamp"),
    "moe_router_aux_loss": same("moe"),
    "model_forward_wrapper": same("forward_wrapper", owner="a"),
    "model_forward_override": same("forward_override", owner="a"),
    "frozen_layers_bf16": same("frozen_bf16", owner="a"),
    "iterable_dataset": same("iterable", owner="a"),
    "sequence_classification_model": refused({"_model": "seq_cls"}, r"ForCausalLM", where="train", owner="a"),
    "token_classification_model": refused({"_model": "tok_cls"}, r"ForCausalLM", where="train", owner="a"),
}

# Issue #28 part A's rows and the outcome that change intends (the lead adjusts at merge): model_init trains each
# trial with a fresh plan; optimizers= / optimizer_cls_and_kwargs= and torch_compile are refused while streaming; a
# forward wrapper or override runs, frozen layers stay frozen, an iterable dataset trains; other heads are refused
# naming the supported (*ForCausalLM) classes.
CONTRACT_A = {
    name: row.verdict for table in (FIELDS, INIT_ARGS, INPUTS) for name, row in table.items() if row.owner == "a"
}
