"""What `LazyTrainer` delegates to, one concept per module; none of them imports `transformers.Trainer`.

- `planning`: the plan a run trains with (profile, timed warm-up, solve or baseline; plan files; the checks made
  before anything is attached or allocated).
- `checkpoints`: what a run writes to disk and reads back (atomic checkpoints, fp32 masters, plan next to the
  weights, verification before resume, the model card section).
- `updater`: `LayerwiseUpdater`, the optimizer step of a streamed model, layer by layer, overlapping the next
  forward.
- `contract`: what of the user's set-up is honoured and what is refused at construction (issue #28): optimizer
  paths, trainer classes, model heads, a user's forward, datasets without a length.
- `dataparallel`: the once-per-step mean of a layer's gradients over the data-parallel ranks.
"""
