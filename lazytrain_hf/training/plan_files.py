"""The plan file next to a checkpoint and in ``output_dir``: its name (`PLAN_FILE`), writing and reading it.

A leaf of the training floor that `lazytrain_hf.args` may import (``planner_plan`` names a checkpoint's plan file)
without importing the rest of the checkpoint code.
"""

from __future__ import annotations

import os

from .staging import atomic_write_text

PLAN_FILE = "lazytrain_plan.json"  # the plan next to a checkpoint (also written to output_dir)


def write_plan(plan, directory: str) -> None:
    """Write ``plan`` as ``directory``/lazytrain_plan.json (atomically)."""
    os.makedirs(directory, exist_ok=True)
    atomic_write_text(os.path.join(directory, PLAN_FILE), plan.to_json())


def read_plan(checkpoint_dir: str):
    """The plan saved with a checkpoint (or None). Corrupted files raise an error naming the file."""
    from ..planner.plan import Plan

    path = os.path.join(checkpoint_dir, PLAN_FILE)
    if not os.path.exists(path):
        return None
    return Plan.from_json(path)
