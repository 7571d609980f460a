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

    import hashlib
    import json

    from trainer_fixtures import make_trainer
    from transformers import TrainerCallback

    class RecordDigest(TrainerCallback):
        """Write the SHA-256 of every file of checkpoint-1 once its save has completed."""

        def on_save(self, args, state, control, **kw):
            if state.global_step != 1:
                return
            ckpt = os.path.join(a.out, "checkpoint-1")
            digest = {}
            for root, _, files in os.walk(ckpt):
                for f in sorted(files):
                    full = os.path.join(root, f)
                    with open(full, "rb") as fh:
                        digest[os.path.relpath(full, ckpt)] = hashlib.sha256(fh.read()).hexdigest()
            with open(os.path.join(a.out, "checkpoint-1.sha256.json"), "w") as fh:
                json.dump(digest, fh)

    trainer = make_trainer(a.out, max_steps=a.max_steps, save_steps=1, stream=a.stream == "true")
    trainer.add_callback(RecordDigest())
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
