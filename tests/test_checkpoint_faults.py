"""Checkpoints are atomic: a process killed while saving leaves the previous checkpoint as the latest, intact."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers.trainer_utils import get_last_checkpoint

HERE = os.path.dirname(__file__)


def _tree_digest(path: str) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(path):
        for f in sorted(files):
            full = os.path.join(root, f)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _run(args: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE)]))
    env.update(env_extra or {})
    return subprocess.run([sys.executable, os.path.join(HERE, "helpers", "train_and_kill.py"), *args],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("stream", ["false", "true"])
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, stream):
    out = tmp_path / "run"
    proc = _run(["--out", str(out), "--kill-at-step", "2", "--max-steps", "3", "--stream", stream])
    assert proc.returncode == -9, proc.stderr[-3000:]
    # the half-written checkpoint-2 is not in place; checkpoint-1 is the latest and complete
    assert not (out / "checkpoint-2").exists()
    last = get_last_checkpoint(str(out))
    assert last is not None and os.path.basename(last) == "checkpoint-1"
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        assert (out / "checkpoint-1" / name).exists(), name
    # checkpoint-1's bytes are exactly what its completed save wrote (digest recorded by the subprocess then)
    recorded = json.load(open(out / "checkpoint-1.sha256.json"))
    assert recorded and _tree_digest(str(out / "checkpoint-1")) == recorded

    # resuming from it works and the stale staging directory is cleaned
    from trainer_fixtures import make_trainer

    trainer = make_trainer(str(out), max_steps=3, save_steps=1, stream=stream == "true")
    state = torch.load(out / "checkpoint-1" / "optimizer.pt", weights_only=True)  # loads safely
    assert "state" in state
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 3
    assert (out / "checkpoint-3").exists()
    assert not [d for d in os.listdir(out) if d.startswith(".staging-")]
