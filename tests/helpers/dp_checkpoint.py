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

import json
import os
import signal

from dp_common import base_parser, rank, save_rank_weights, trainer_options


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
    p = base_parser(max_steps=4)
    p.add_argument("--run-dir", default=None, help="output_dir (default <out>/run)")
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--resume", default=None, help="a checkpoint directory, or 'last'")
    a = p.parse_args()

    from trainer_fixtures import make_trainer

    run_dir = a.run_dir or os.path.join(a.out, "run")
    trainer = make_trainer(run_dir, save_steps=a.save_steps, planner_policy="default", **trainer_options(a))
    _install_kill(trainer, rank())
    resume = True if a.resume == "last" else a.resume
    trainer.train(resume_from_checkpoint=resume)
    save_rank_weights(trainer, a.out)
    with open(os.path.join(a.out, f"rank{rank()}.json"), "w") as f:
        json.dump({"losses": trainer.loss_recorder.losses, "global_step": trainer.state.global_step}, f)


if __name__ == "__main__":
    main()
