"""The micro-batch a plan is made for: the longest one the training data can produce, never only the first.

Note: [The plan is made for the longest batch]
    The planner sizes activations, slots and the loss chunks from one collated micro-batch. Taking the dataset's
    first rows sized the plan for whatever they happened to hold: with 4-token first rows and 48-token later ones the
    measured device peak reached 5x ``planner_gpu_budget`` (on a GPU an out-of-memory error mid-epoch). The sample
    batch is therefore collated from the ``per_device_train_batch_size`` longest rows (`longest_rows`, a length scan
    of the ``input_ids`` column; Arrow's list lengths for a `datasets.Dataset`, no row is decoded), so a collator
    that pads to the longest row gives the longest batch training can see; one that pads to a fixed ``max_length``
    gives that length whatever the rows. Data whose rows cannot be scanned (an iterable dataset, rows without
    ``input_ids``) are planned from their first rows, and `check_batch_planned` refuses, naming the fix, a training
    batch longer than the plan's ``seq_len`` when it arrives instead of running over the budget (a plan file given as
    ``planner_plan`` is executed as is: a warning, once).
    Test: ``tests/test_trainer_honoured.py::test_plan_holds_for_the_longest_batch``.

Functions take the dataset, plans and batches as arguments; this module never imports `transformers.Trainer`.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)


def row_lengths(dataset: Any) -> list[int] | None:
    """The length of every row's ``input_ids`` of a map-style ``dataset``, or None where rows cannot be scanned (no
    ``len()``, rows that are not mappings with ``input_ids``)."""
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        return None
    import datasets

    if isinstance(dataset, datasets.Dataset):
        if "input_ids" not in dataset.column_names:
            return None
        import pyarrow as pa
        import pyarrow.compute as pc

        column = dataset.with_format("arrow").select_columns(["input_ids"])[:]["input_ids"]
        try:
            return [int(n) for n in pc.list_value_length(column).to_pylist()]
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, TypeError):
            pass  # not a list column (e.g. a fixed-shape array): read the rows below
    lengths = []
    for i in range(len(dataset)):
        row = dataset[i]
        ids = row.get("input_ids") if isinstance(row, dict) else None
        if ids is None:
            return None
        lengths.append(len(ids))
    return lengths


def longest_rows(dataset: Any, n: int) -> list[int]:
    """Indices of the ``n`` longest rows of ``dataset`` (Note: [The plan is made for the longest batch]); the first
    ``n`` rows where the rows cannot be scanned. Ties keep dataset order."""
    lengths = row_lengths(dataset)
    if lengths is None:
        return list(range(n))
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return sorted(order[:n])


def sample_rows(dataset: Any, n: int) -> list[Any]:
    """The rows the plan's batch is collated from (Note: [The plan is made for the longest batch]): the ``n``
    longest of a map-style dataset, the first ``n`` of one without a length (an iterable dataset: its first batch,
    read from a new iterator: the training dataloader's is not touched)."""
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return [dataset[i] for i in longest_rows(dataset, min(n, len(dataset)))]
    return list(itertools.islice(iter(dataset), n))


def check_batch_planned(plan: Any, inputs: dict[str, Any], from_file: bool = False) -> bool:
    """Refuse a training micro-batch longer than the plan's ``seq_len`` (Note: [The plan is made for the longest
    batch]): its activations would exceed what the plan placed within ``planner_gpu_budget``. A plan file
    (``planner_plan``, ``from_file``) is executed as is, its ``seq_len`` the caller's: a warning instead. Returns
    whether the batch is longer."""
    ids = inputs.get("input_ids")
    if plan is None or not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        return False
    T = int(ids.shape[1])
    if T > plan.seq_len and from_file:
        logger.warning(
            f"a training batch of {T} tokens per sequence arrived; the plan file (planner_plan) was made for "
            f"seq_len={plan.seq_len}, so its activations may exceed its device budget. Make the plan for the longest "
            "sequence (`lazytrain plan --seq-len N --save plan.json`)."
        )
    elif T > plan.seq_len:
        raise ValueError(
            f"a training batch of {T} tokens per sequence arrived, but the plan was made for seq_len={plan.seq_len} "
            f"(the longest rows the data showed when train() started), so its activations would exceed "
            "planner_gpu_budget. Pad every batch to a fixed length (e.g. a collator with padding='max_length' and "
            "max_length set, or truncate the rows), use a map-style dataset with an 'input_ids' column (its rows "
            "are scanned for the longest), or pass planner_plan made for the longest sequence "
            "(`lazytrain plan --seq-len N --save plan.json`)."
        )
    return T > plan.seq_len
