"""What a LazyTrain run writes to disk and reads back, besides what `transformers.Trainer` itself saves.

Owns the checkpoint protocol on disk and the parts that are not a concept of their own: the plan next to the weights
(`PLAN_FILE`, `write_plan` / `read_plan`), which checkpoint a resume means (`resolve_checkpoint`), the check of every
file a resume reads (`verify_checkpoint`) and the model card section. The rest lives in modules of its own, whose
public names are importable from here too:

- `training/staging.py`: staging directories renamed into place (Note: [Atomic checkpoints]);
- `training/masters.py`: the fp32 masters file (Note: [fp32 masters in checkpoints]);
- `training/nvme_optimizer_state.py`: the optimizer state of units on NVMe (Note: [Checkpoints of the state on
  NVMe]);
- `training/safetensors_writer.py` and `training/weight_files.py`: the weights of a streamed model written layer by
  layer from the host store (`save_streamed`, Note: [Checkpoints are streamed from the host store]);
- `training/resume_weights.py` and `weight_layout.py`: the weights a resume loads in the format
  `save_pretrained` wrote them (`load_checkpoint_weights`, Note: [Checkpoint weights in the saved format]).

Functions take directories, plans, the model and the executor's objects (`StreamHandle`, `LayerwiseUpdater`) as
arguments: this module never imports `transformers.Trainer` or the trainer floor (`args`, `trainer`, `trl`), never
writes optimizer or scheduler files (Trainer's `_save_checkpoint` does, into the staging directory) and moves nothing
to the device.
"""

from __future__ import annotations

import json
import os

import torch

from ..units import format_bytes
from .masters import MASTER_FILE, restore_masters, separate_masters, unsaved_masters
from .nvme_optimizer_state import NVME_STATE_FILE, restore_nvme_optimizer_state, write_nvme_optimizer_state
from .partition_files import verify_partitions
from .plan_files import PLAN_FILE, read_plan, write_plan
from .resume_weights import check_weights_cover, checkpoint_error, load_checkpoint_weights
from .safetensors_writer import SAFETENSORS_DTYPES, SafetensorsWriter, write_safetensors
from .saved_weights import cast_overrides
from .staging import STAGING_PREFIX, atomic_write_text, publish_checkpoint, remove_stale_staging, staging_dir
from .weight_files import save_streamed, streams_weights, write_model_weights

__all__ = [
    "MASTER_FILE",
    "NVME_STATE_FILE",
    "PLAN_FILE",
    "SAFETENSORS_DTYPES",
    "STAGING_PREFIX",
    "SafetensorsWriter",
    "append_card_section",
    "atomic_write_text",
    "check_weights_cover",
    "checkpoint_error",
    "complete_checkpoint",
    "lazytrain_card_section",
    "load_checkpoint_weights",
    "publish_checkpoint",
    "read_plan",
    "remove_stale_staging",
    "resolve_checkpoint",
    "restore_masters",
    "restore_nvme_optimizer_state",
    "save_streamed",
    "separate_masters",
    "staging_dir",
    "streams_weights",
    "unsaved_masters",
    "verify_checkpoint",
    "write_model_weights",
    "write_nvme_optimizer_state",
    "write_plan",
    "write_safetensors",
]


# ---------------------------------------------------------------------- reading
def complete_checkpoint(staging_root: str, final: str, handle, updater) -> None:
    """Complete the checkpoint Trainer staged in ``staging_root`` and rename it to ``final`` (`publish_checkpoint`,
    Note: [Atomic checkpoints]): the fp32 masters of ``handle`` (a `StreamHandle` or None) and ``updater`` once the
    step in flight has finished, and the optimizer state of units on NVMe (Note: [Checkpoints of the state on NVMe])."""
    masters = unsaved_masters(handle, updater)
    # Note: [A checkpoint holds the model in its own dtype] in training/saved_weights.py: in the weights already
    for name in cast_overrides(handle):
        masters.pop(name, None)
    write_nvme_optimizer_state(os.path.join(staging_root, os.path.basename(final)), handle)
    publish_checkpoint(staging_root, final, masters)


def resolve_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint directory ``resume_from_checkpoint`` names (True: the last one in ``output_dir``), or None."""
    from transformers.trainer_utils import get_last_checkpoint

    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        last = get_last_checkpoint(output_dir)
        if last is None:
            raise ValueError(
                f"resume_from_checkpoint=True but no checkpoint-<N> directory is in output_dir="
                f"{output_dir!r}; pass a checkpoint path or start without resuming."
            )
        return last
    if not os.path.isdir(resume_from_checkpoint):
        raise ValueError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} is not a directory; pass a checkpoint-<N> path."
        )
    return str(resume_from_checkpoint)


def verify_checkpoint(checkpoint_dir: str, model=None) -> None:
    """Open every file a resume reads (weights, optimizer, scheduler and RNG states, trainer state, plan) without
    loading it into the model; a corrupted or truncated one raises ValueError naming the file, and so does a
    missing partition of a checkpoint written by several ranks (`verify_partitions`). (`training_args.bin`
    is written by Trainer for reference only and never read back.) With ``model``, the weights must also cover every
    parameter and buffer it saves, once converted as a resume converts them (`check_weights_cover`)."""
    from safetensors import safe_open

    from ..planner.plan import Plan

    optimizer_state = None
    for name in sorted(os.listdir(checkpoint_dir)):
        path = os.path.join(checkpoint_dir, name)
        try:
            if name.endswith(".safetensors"):
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        f.get_slice(key)  # header and offsets are checked against the file size
                size = os.path.getsize(path)
                with open(path, "rb") as fh:
                    header_len = int.from_bytes(fh.read(8), "little")
                    header = json.loads(fh.read(header_len))
                end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
                if 8 + header_len + end != size:
                    raise ValueError(f"size {size} bytes, header describes {8 + header_len + end}")
            elif name in ("optimizer.pt", "scheduler.pt", "scaler.pt") or (
                name.startswith("rng_state") and name.endswith(".pth")
            ):
                from transformers.trainer_pt_utils import safe_globals

                with safe_globals():  # the numpy RNG types Trainer's rng_state.pth holds, as Trainer loads it
                    loaded = torch.load(path, map_location="cpu", weights_only=True)
                if name == "optimizer.pt" and isinstance(loaded, dict):
                    optimizer_state = loaded
            elif name == PLAN_FILE:
                Plan.from_json(path)
            elif name.endswith(".json"):
                with open(path) as fh:
                    json.load(fh)
        except Exception as e:
            raise ValueError(
                f"checkpoint file {path} is corrupted or truncated ({type(e).__name__}: {e}); resume from an "
                f"earlier checkpoint-<N> directory or delete this one."
            ) from e
    # Note: [A checkpoint of a partitioned state] in training/partition_files.py: every rank's partition is there
    verify_partitions(checkpoint_dir, optimizer_state)
    if model is not None:
        check_weights_cover(checkpoint_dir, model)


# ---------------------------------------------------------------------- model card
def lazytrain_card_section(plan, log_history: list[dict]) -> str:
    """Model-card section: the plan that trained the model and the throughput measured while training."""
    measured = [h for h in log_history if "tokens_per_s" in h]
    last = measured[-1] if measured else {}
    lines = [
        "## LazyTrain",
        "",
        "Trained with lazytrain_hf (layer streaming, planned activations, Hybrid 8-bit).",
        "",
        "```",
        plan.table(),
        "```",
        "",
    ]
    if last:
        lines.append(
            f"Measured: {last['tokens_per_s']:.1f} tokens/s, {last.get('tflops', 0.0):.3f} TFLOPS, "
            f"peak device memory {format_bytes(last.get('peak_device_bytes'))}."
        )
    return "\n".join(lines)


def append_card_section(card_path: str, plan, log_history: list[dict]) -> None:
    """Append `lazytrain_card_section` to the model card at ``card_path`` (nothing when there is no card)."""
    if not os.path.exists(card_path):
        return
    with open(card_path) as f:
        card = f.read()
    card += "\n" + lazytrain_card_section(plan, log_history) + "\n"
    atomic_write_text(card_path, card)
