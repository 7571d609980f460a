"""Body of tests/test_given_back.py's mmap-threshold test, in a process of its own (glibc's malloc settings are the
process's): raise glibc's dynamic mmap threshold (a 20 MB block mapped and freed), then attach the executor as one
``rank`` of a partitioned run (``--owners``) or as one process, and print, as JSON, whether an 8 MB block is served
from the heap before and after."""

from __future__ import annotations

import json
import sys

import torch
from conftest import tiny_model

from lazytrain_hf import models
from lazytrain_hf.planner.plan import Plan
from lazytrain_hf.streaming import attach


def in_heap(t: torch.Tensor) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[heap]"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= t.data_ptr() < hi:
                    return True
    return False


def main() -> None:
    big = torch.empty(20 << 20, dtype=torch.uint8)
    del big  # glibc raises its threshold to 20 MB
    probe = torch.empty(8 << 20, dtype=torch.uint8)
    before = in_heap(probe)
    del probe
    model = tiny_model("qwen3")
    kinds = models.layer_kinds(model)
    owners = {k: k % 2 for k in range(len(kinds))} if "--owners" in sys.argv else None
    handle = attach(model, plan=Plan.default(len(kinds), kinds=kinds), device="cpu", unit_owners=owners, rank=0)
    probe = torch.empty(8 << 20, dtype=torch.uint8)
    after = in_heap(probe)
    handle.remove()
    print(json.dumps({"before": before, "after": after}))


if __name__ == "__main__":
    main()
