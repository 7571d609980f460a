"""Subprocess of tests/test_state_nvme.py: trains with the whole state on NVMe and either saves the committed state
after step 2 (``reference``) or kills itself with SIGKILL in the middle of step 3's write-back (``kill``)."""

from __future__ import annotations

import os
import signal
import sys

import torch
from trainer_fixtures import make_trainer
from transformers import TrainerCallback

import lazytrain_hf.streaming.nvmestate as ns
from lazytrain_hf.planner import layouts


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    os.makedirs(os.path.join(root, "state"), exist_ok=True)
    layouts.CHUNK_ELEMS = 4096
    handle = {}

    class Dump(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            spill = handle["t"].stream_handle.nvme_state
            if mode == "reference" and state.global_step == 2:
                torch.save(ns.read_committed(spill.path), os.path.join(root, "committed_step2.pt"))

    if mode == "kill":
        real = ns.NvmeState._pwrite
        count = {"n": 0}

        def pwrite(self, u, buf, nbytes, offset):
            if self.step == 2:  # step 3's write-back: die after some of its writes landed
                count["n"] += 1
                if count["n"] == 7:
                    with open(os.path.join(root, "writes.txt"), "w") as f:
                        f.write(str(count["n"] - 1))
                        f.flush()
                        os.fsync(f.fileno())
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(self, u, buf, nbytes, offset)

        ns.NvmeState._pwrite = pwrite
    t = make_trainer(
        os.path.join(root, "out"),
        max_steps=3,
        planner_policy="default",
        state_nvme_dir=os.path.join(root, "state"),
        state_nvme_layers="all",
    )
    handle["t"] = t
    t.add_callback(Dump())
    t.train()


if __name__ == "__main__":
    main()
