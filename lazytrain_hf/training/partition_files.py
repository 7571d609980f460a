"""The files of a checkpoint written by ranks whose training state is partitioned by unit: names, layout records,
verification and reading by parameter name.

Note: [A checkpoint of a partitioned state]
    With the training state partitioned by unit (Note: [The training state is partitioned by unit] in
    planner/world.py) no rank holds every unit's fp32 masters and 8-bit moments, so a checkpoint is written by every
    rank into one staging directory (rank 0's, its name broadcast; Note: [Atomic checkpoints] in
    training/staging.py):

    - ``model.safetensors`` (or its shards and index, as `save_pretrained` writes them) by rank 0 with every unit's
      values, the same file a single process writes: every unit's compute copy is readable on every rank (the
      node's shared copy, training/dataparallel.py), and where the saved weight is the fp32 master (Note: [A
      checkpoint holds the model in its own dtype] in training/saved_weights.py) rank 0 receives the masters of
      the units it does not own from their owners, one unit at a time in unit order (`training/partitions.py`);
    - per rank ``r`` of ``W``: ``lazytrain_partition-<r>-of-<W>.safetensors`` (`partition_name`), for each
      trainable parameter of the units ``r`` owns: ``<name>.exp_avg_codes``, ``.exp_avg_absmax``,
      ``.exp_avg_sq_codes``, ``.exp_avg_sq_absmax`` (8-bit moments and their block scales), or ``.exp_avg`` /
      ``.exp_avg_sq`` below ``min_8bit_size`` (the keys of `NVME_STATE_FILE`); and ``<name>.master`` for the fp32
      masters the weights file does not hold bit for bit (a bf16 model's; the same rule as
      ``lazytrain_master.safetensors`` of one process). Units whose state is on
      NVMe (``state_nvme_dir``) are read from the rank's own state files. Beside it
      ``lazytrain_partition-<r>-of-<W>.json`` (`layout_name`), the layout record: ``world_size``, ``rank``,
      ``unit_order`` (every streamed unit's key), ``owners`` (unit key -> rank), ``units`` (this rank's unit keys
      -> their trainable parameter names), ``masters`` and ``states`` (the names whose master / moments the file
      holds), ``steps`` (name -> optimizer step count), ``block_size``;
    - ``optimizer.pt`` (Trainer's, by rank 0) holds the state of the resident parameters only, which every rank
      updates identically; its ``lazytrain_partitioned`` entry says so and gives the world size; masters of
      resident parameters go to ``lazytrain_master.safetensors`` as on one process; scheduler, trainer state and
      ``rng_state_<r>.pth`` as Trainer writes them.

    Every rank writes and flushes its partition, a barrier follows, then rank 0 renames the staging directory into
    place: a checkpoint is published with every partition or not at all. `verify_partitions` checks that every
    partition ``0..W-1`` is there with one layout. A resume takes, by parameter name, each state from whichever
    file holds it (`PartitionIndex`), so the same checkpoint resumes at any world size, and a checkpoint of one
    process (its ``optimizer.pt`` complete) resumes on several ranks. Tests: ``tests/test_trainer_dp_checkpoints.py``.

This module reads and names files; it imports nothing of the executor.
"""

from __future__ import annotations

import json
import os
import re

import torch

PARTITION_PREFIX = "lazytrain_partition-"
LAYOUT_FORMAT = 1
# the entry of a partitioned run's optimizer.pt that says it holds the resident parameters only
PARTITIONED_KEY = "lazytrain_partitioned"
STATE_SUFFIXES = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax", "exp_avg", "exp_avg_sq")
_NAME_RE = re.compile(r"^lazytrain_partition-(\d{5})-of-(\d{5})\.(safetensors|json)$")


def partition_name(rank: int, world_size: int) -> str:
    """The tensors file of rank ``rank`` of ``world_size`` (Note: [A checkpoint of a partitioned state])."""
    return f"{PARTITION_PREFIX}{rank:05d}-of-{world_size:05d}.safetensors"


def layout_name(rank: int, world_size: int) -> str:
    """The layout record of rank ``rank`` of ``world_size``."""
    return f"{PARTITION_PREFIX}{rank:05d}-of-{world_size:05d}.json"


def partition_files(checkpoint: str | None) -> dict[int, tuple[int, set[str]]]:
    """``{rank: (world_size, {"safetensors", "json"})}`` of the partition files in ``checkpoint``."""
    out: dict[int, tuple[int, set[str]]] = {}
    if not checkpoint or not os.path.isdir(checkpoint):
        return out
    for name in os.listdir(checkpoint):
        m = _NAME_RE.match(name)
        if m:
            rank, world, ext = int(m.group(1)), int(m.group(2)), m.group(3)
            out.setdefault(rank, (world, set()))[1].add(ext)
    return out


def is_partitioned(checkpoint: str | None) -> bool:
    """Whether ``checkpoint`` was written by ranks with a partitioned training state."""
    return bool(partition_files(checkpoint))


def verify_partitions(checkpoint: str, optimizer_state: dict | None = None) -> None:
    """Every partition of the checkpoint is there, both files, with one world size and one owner map (Note: [A
    checkpoint of a partitioned state]); ``optimizer_state``: its ``optimizer.pt`` (already loaded), whose
    `PARTITIONED_KEY` entry names the world size even when every partition file is gone."""
    found = partition_files(checkpoint)
    marked = (optimizer_state or {}).get(PARTITIONED_KEY)
    if not found and not marked:
        return
    worlds = {w for w, _ in found.values()}
    if marked:
        worlds.add(int(marked["world_size"]))
    if len(worlds) != 1:
        raise ValueError(
            f"checkpoint {checkpoint} mixes partitions of world sizes {sorted(worlds)}: it was written over another "
            "checkpoint's files. Resume from an earlier checkpoint-<N> directory or delete this one."
        )
    world = worlds.pop()
    missing = [
        f"{partition_name(r, world)} / {layout_name(r, world)}"
        for r in range(world)
        if r not in found or found[r][1] != {"safetensors", "json"}
    ]
    if missing:
        raise ValueError(
            f"checkpoint {checkpoint} was written by {world} ranks with the training state partitioned by unit, but "
            f"the partition files {missing} are missing: the masters and optimizer state of their units are lost. "
            "Resume from an earlier checkpoint-<N> directory or delete this one."
        )
    owners = None
    for r in range(world):
        path = os.path.join(checkpoint, layout_name(r, world))
        with open(path) as f:
            layout = json.load(f)
        if layout.get("format") != LAYOUT_FORMAT or layout.get("rank") != r or layout.get("world_size") != world:
            raise ValueError(
                f"checkpoint file {path} is not the layout record of rank {r} of {world} (format {LAYOUT_FORMAT}); "
                "it is corrupted or was written by another version. Resume from an earlier checkpoint-<N> directory."
            )
        if owners is None:
            owners = layout["owners"]
        elif layout["owners"] != owners:
            raise ValueError(
                f"checkpoint file {path} records other unit owners than rank 0's layout: the partitions come from "
                "different runs. Resume from an earlier checkpoint-<N> directory or delete this one."
            )


class PartitionIndex:
    """Which partition file of ``checkpoint`` holds each parameter's master and optimizer state, read by name
    (`master`, `state`); empty for a checkpoint without partitions."""

    def __init__(self, checkpoint: str | None):
        self.checkpoint = checkpoint
        self._where: dict[str, str] = {}  # name -> file holding its state
        self._masters: dict[str, str] = {}  # name -> file holding its master
        self.steps: dict[str, int] = {}
        self.names: set[str] = set()  # every trainable parameter of a partitioned unit
        self.block_size: int | None = None
        for rank, (world, _) in sorted(partition_files(checkpoint).items()):
            with open(os.path.join(checkpoint, layout_name(rank, world))) as f:
                layout = json.load(f)
            path = os.path.join(checkpoint, partition_name(rank, world))
            for names in layout["units"].values():
                self.names.update(names)
            for n in layout["states"]:
                self._where[n] = path
            for n in layout["masters"]:
                self._masters[n] = path
            self.steps.update({k: int(v) for k, v in layout["steps"].items()})
            self.block_size = int(layout["block_size"])

    def __bool__(self) -> bool:
        return bool(self.names)

    def has_master(self, name: str) -> bool:
        return name in self._masters

    def master(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._masters[name], framework="pt") as f:
            return f.get_tensor(f"{name}.master")

    def state(self, name: str, shape: tuple[int, ...]) -> dict | None:
        """The saved optimizer state of ``name`` in `HybridAdamW8bit.state_dict` form (``step``, and
        ``exp_avg_codes`` / ``exp_avg_absmax`` / ... or ``exp_avg`` / ``exp_avg_sq`` of ``shape``); None when the
        parameter had no state yet."""
        path = self._where.get(name)
        if path is None:
            return None
        from safetensors import safe_open

        out: dict = {"step": self.steps[name]}
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
            for suffix in STATE_SUFFIXES:
                key = f"{name}.{suffix}"
                if key in keys:
                    t = f.get_tensor(key)
                    out[suffix] = t.view(shape) if suffix in ("exp_avg", "exp_avg_sq") else t
        return out
