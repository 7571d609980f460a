"""Subprocess body for the checkpoint fault tests: train a tiny model with a save every step and SIGKILL itself
in the middle of writing the checkpoint of step `--kill-at-step` (after the weights, before the optimizer state)."""

from __future__ import annotations

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kill-at-step", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--stream", default="false")
    a = p.parse_args()

    from trainer_fixtures import make_trainer

    trainer = make_trainer(a.out, max_steps=a.max_steps, save_steps=1, stream=a.stream == "true")
    if a.kill_at_step:
        original = trainer._save_optimizer_and_scheduler

        def dying_save(output_dir: str) -> None:
            if trainer.state.global_step == a.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            original(output_dir)

        trainer._save_optimizer_and_scheduler = dying_save
    trainer.train()


if __name__ == "__main__":
    main()
