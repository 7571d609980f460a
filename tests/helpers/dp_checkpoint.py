"""Checkpoint and resume body for tests/test_trainer_dp_checkpoints.py: run under `torchrun --nproc_per_node N`
(gloo on CPU) or as one process. Trains the tiny qwen3 (optionally with ``bf16=True`` over its fp32 weights, or its
state on NVMe), saving every ``--save-steps``; with ``--resume`` it resumes from that checkpoint. Writes this rank's
weights after train() to <out>/rank<R>.safetensors and its losses and last step to <out>/rank<R>.json.

Faults for the tests, read from the environment by this script only (never by the library):
``DP_TEST_KILL=mid-step``: rank ``DP_TEST_KILL_RANK`` (default 1) SIGKILLs itself during optimizer step
``DP_TEST_KILL_STEP`` (1-based), in the backward of its second unit (the second gradient reduce of that step);
``DP_TEST_KILL=mid-save``: the same rank SIGKILLs itself while it writes its partition of the checkpoint of step
``DP_TEST_KILL_STEP``, after the first tensor of the partition file; ``DP_TEST_KILL=hang-step``: as ``mid-step`` but
SIGSTOP (the rank stops answering without dying).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _install_kill(trainer, rank: int) -> None:
    where = os.environ.get("DP_TEST_KILL")
    if not where or rank != int(os.environ.get("DP_TEST_KILL_RANK", "1")):
        return
    step = int(os.environ.get("DP_TEST_KILL_STEP", "3"))
    if where in ("mid-step", "hang-step"):
        from lazytrain_hf.training.dataparallel import PartitionedDataParallel

        real = PartitionedDataParallel.reduce_to_owner
        calls = []

        def reduce_then_die(self, unit, *args, **kwargs):
            if trainer.state.global_step == step - 1:
                calls.append(unit)
                if len(calls) == 2:
                    sig = signal.SIGKILL if where == "mid-step" else signal.SIGSTOP
                    print(f"rank {rank}: {sig.name} in the backward of unit {unit}, step {step}", flush=True)
                    os.kill(os.getpid(), sig)
            return real(self, unit, *args, **kwargs)

        PartitionedDataParallel.reduce_to_owner = reduce_then_die
    elif where == "mid-save":
        from lazytrain_hf.training import safetensors_writer

        real_write = safetensors_writer.SafetensorsWriter.write

        def write_then_die(self, name, tensor):
            real_write(self, name, tensor)
            partition = os.path.basename(self.path).startswith("lazytrain_partition-")
            if partition and trainer.state.global_step == step:
                self._f.flush()
                print(f"rank {rank}: SIGKILL after writing {name} into {self.path}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        safetensors_writer.SafetensorsWriter.write = write_then_die
    else:
        raise ValueError(f"DP_TEST_KILL={where!r}: use mid-step or mid-save.")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--run-dir", default=None, help="output_dir (default <out>/run)")
    p.add_argument("--per-device-batch", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--resume", default=None, help="a checkpoint directory, or 'last'")
    p.add_argument("--bf16", action="store_true", help="bf16 compute of the fp32 model (masters in the weights)")
    p.add_argument("--state-nvme", default=None, help="state_nvme_dir (every streamed unit's state there)")
    a = p.parse_args()

    from safetensors.torch import save_file
    from trainer_fixtures import make_trainer

    rank = int(os.environ.get("RANK", "0"))
    extra = {}
    if a.state_nvme:
        os.makedirs(a.state_nvme, exist_ok=True)
        extra.update(state_nvme_dir=a.state_nvme, state_nvme_layers="all")
    if a.bf16:
        extra.update(bf16=True)
    trainer = make_trainer(
        a.run_dir or os.path.join(a.out, "run"),
        max_steps=a.max_steps,
        save_steps=a.save_steps,
        per_device_train_batch_size=a.per_device_batch,
        planner_policy="default",
        dataloader_drop_last=True,
        **extra,
    )
    _install_kill(trainer, rank)
    resume = True if a.resume == "last" else a.resume
    trainer.train(resume_from_checkpoint=resume)
    state = {k: v.detach().contiguous().clone() for k, v in trainer.model.state_dict().items()}
    os.makedirs(a.out, exist_ok=True)
    save_file(state, os.path.join(a.out, f"rank{rank}.safetensors"))
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": trainer.loss_recorder.losses, "global_step": trainer.state.global_step}, f)


if __name__ == "__main__":
    main()
