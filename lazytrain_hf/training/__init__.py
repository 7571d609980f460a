"""What `LazyTrainer` delegates to, one concept per module; none of them imports `transformers.Trainer` or the
trainer floor (`args`, `trainer`, `trl`): they take the model, the arguments and the executor's objects as values.

- `planning`: the plan a run trains with (profile, timed warm-up, solve or baseline; plan files; the checks made
  before anything is attached or allocated; one plan for every data-parallel rank).
- `checkpoints`: what a run writes to disk and reads back (which checkpoint a resume means, verification before
  resume, the model card section) and, importable from it, the parts with modules of their own: `staging` (atomic
  checkpoints), `masters` (the fp32 masters file), `nvme_optimizer_state` (optimizer state of units on NVMe),
  `plan_files` (the plan next to the weights), `safetensors_writer` and `weight_files` (weights written layer by
  layer from the host store), `resume_weights` (the weights a resume loads, in the saved format).
- `updater`: `LayerwiseUpdater`, the optimizer step of a streamed model, layer by layer, overlapping the next
  forward.
- `contract`: what of the user's set-up is honoured and what is refused at construction (issue #28): optimizer
  paths, trainer classes, model heads, a user's forward, datasets without a length.
- `dataparallel`: the once-per-step mean of a layer's gradients over the data-parallel ranks.
- `run_trace`: the executor's trace of the first steps written beside the plan; `throughput`: the throughput logs.
- `arg_upgrades`: the maintained `TrainingArguments` combinations (trl's `SFTConfig` -> `LazySFTConfig`).
- `batches`, `optimizer_groups`, `saved_weights`, `user_access`, `lazytensor`: see their docstrings.
"""
