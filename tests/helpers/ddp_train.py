"""Data-parallel body for tests/test_trainer_ddp.py: run under `torchrun --nproc_per_node N` (gloo on CPU) or as a
single process; writes this rank's final weights to <out>/rank<R>.safetensors."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--per-device-batch", type=int, default=2)
    p.add_argument("--policy", default="default")
    a = p.parse_args()

    from safetensors.torch import save_file
    from trainer_fixtures import make_trainer

    from lazytrain_hf.training import planning

    rank = int(os.environ.get("RANK", "0"))
    planned = []
    real_make_plan = planning.make_plan

    def counting_make_plan(*args, **kwargs):
        planned.append(rank)
        return real_make_plan(*args, **kwargs)

    planning.make_plan = counting_make_plan  # which ranks profile, warm up and solve
    trainer = make_trainer(
        os.path.join(a.out, "run"),
        max_steps=3,
        per_device_train_batch_size=a.per_device_batch,
        planner_policy=a.policy,
        dataloader_drop_last=True,
    )
    trainer.train()
    state = {k: v.detach().contiguous().clone() for k, v in trainer.model.state_dict().items()}
    save_file(state, os.path.join(a.out, f"rank{rank}.safetensors"))
    losses = ",".join(f"{x:.8f}" for x in trainer.loss_recorder.losses)
    with open(os.path.join(a.out, f"rank{rank}.losses"), "w") as f:
        f.write(losses)
    with open(os.path.join(a.out, f"rank{rank}.plan.json"), "w") as f:
        f.write(trainer.lazy_plan.to_json())
    with open(os.path.join(a.out, f"rank{rank}.planned"), "w") as f:
        f.write(str(len(planned)))


if __name__ == "__main__":
    main()
