"""What the data-parallel bodies tests/helpers/ddp_train.py and tests/helpers/dp_checkpoint.py share: the flags of
the tiny qwen3 run (`base_parser`), the `make_trainer` options they map to (`trainer_options`), this process's rank
and the rank's weights file written after train() (`save_rank_weights`).

Imported by those scripts as ``dp_common`` (their own directory is first on ``sys.path`` when run as a script)."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # trainer_fixtures, conftest


def base_parser(max_steps: int) -> argparse.ArgumentParser:
    """The flags both bodies take: ``--out``, ``--per-device-batch``, ``--max-steps``, ``--state-nvme``, ``--bf16``,
    ``--ga``, ``--dp-reduce-every``."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--per-device-batch", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=max_steps)
    p.add_argument("--state-nvme", default=None, help="state_nvme_dir (every streamed unit's state there)")
    p.add_argument("--bf16", action="store_true", help="bf16 compute copy of the fp32 model (fp32 masters)")
    p.add_argument("--ga", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--dp-reduce-every", default=None, help="planner_dp_reduce_every (auto, micro_batch, step)")
    return p


def trainer_options(a: argparse.Namespace) -> dict:
    """`trainer_fixtures.make_trainer` keyword arguments of the shared flags (the state directory is created)."""
    extra: dict = dict(max_steps=a.max_steps, per_device_train_batch_size=a.per_device_batch)
    extra.update(dataloader_drop_last=True, gradient_accumulation_steps=a.ga)
    if a.dp_reduce_every:
        extra.update(planner_dp_reduce_every=a.dp_reduce_every)
    if a.state_nvme:
        os.makedirs(a.state_nvme, exist_ok=True)
        extra.update(state_nvme_dir=a.state_nvme, state_nvme_layers="all")
    if a.bf16:
        extra.update(bf16=True)
    return extra


def rank() -> int:
    """This process's global rank (``RANK`` of torch.distributed.run; 0 for a plain process)."""
    return int(os.environ.get("RANK", "0"))


def save_rank_weights(trainer, out: str) -> None:
    """The model's state after train() as ``<out>/rank<R>.safetensors``."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in trainer.model.state_dict().items()}
    save_file(state, os.path.join(out, f"rank{rank()}.safetensors"))
