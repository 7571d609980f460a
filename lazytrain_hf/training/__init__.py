"""What `LazyTrainer` delegates to, one concept per module; none of them imports `transformers.Trainer`.

- `planning`: the plan a run trains with (profile, timed warm-up, solve or baseline; plan files; the checks made
  before anything is attached or allocated).
- `checkpoints`: what a run writes to disk and reads back (atomic checkpoints, fp32 masters, plan next to the
  weights, verification before resume, the model card section).
- `updater`: `LayerwiseUpdater`, the optimizer step of a streamed model, layer by layer, overlapping the next
  forward.
"""
