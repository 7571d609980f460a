"""Checkpoints written whole or not at all: the staging directory renamed into place (Note: [Atomic checkpoints]).

Owns `STAGING_PREFIX`, `staging_dir`, `publish_checkpoint` (the staged checkpoint completed with the fp32 masters,
flushed and renamed), `remove_stale_staging` and `atomic_write_text` (a text file replaced in one rename).
"""

from __future__ import annotations

import contextlib
import os
import shutil

import torch

from .masters import MASTER_FILE
from .safetensors_writer import write_safetensors

# Note: [Atomic checkpoints] a checkpoint is written into ``<run_dir>/.staging-<pid>/checkpoint-<N>`` and renamed into
# place once complete (`publish_checkpoint`), so an interrupted save never replaces a good checkpoint with a
# half-written one. `get_last_checkpoint` only matches `checkpoint-<N>`; a staging directory left by a killed process
# is never taken as the latest checkpoint and is removed by the next save (`remove_stale_staging`).
STAGING_PREFIX = ".staging-"


def staging_dir(run_dir: str) -> str:
    """This process's staging directory under ``run_dir`` (Note: [Atomic checkpoints])."""
    return os.path.join(run_dir, f"{STAGING_PREFIX}{os.getpid()}")


def publish_checkpoint(staging_root: str, final: str, masters: dict[str, torch.Tensor]) -> None:
    """Complete the checkpoint staged in ``staging_root/<basename of final>`` with the fp32 ``masters`` (if any),
    flush every file and rename it to ``final``, replacing a checkpoint of the same step (Note: [Atomic
    checkpoints]); ``staging_root`` is removed."""
    staged = os.path.join(staging_root, os.path.basename(final))
    if masters:
        # Note: [Checkpoints are streamed from the host store]: written tensor by tensor from the store's views
        write_safetensors(os.path.join(staged, MASTER_FILE), list(masters.items()))
    _fsync_tree(staged)
    if os.path.exists(final):
        old = final + f".old-{os.getpid()}"
        os.replace(final, old)
        os.replace(staged, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, final)
    _fsync_dir(os.path.dirname(final))
    shutil.rmtree(staging_root, ignore_errors=True)


def remove_stale_staging(run_dir: str) -> None:
    """Remove staging directories of saves that never completed (their process died; Note: [Atomic checkpoints])."""
    if not os.path.isdir(run_dir):
        return
    for name in os.listdir(run_dir):
        if name.startswith(STAGING_PREFIX):
            pid = name[len(STAGING_PREFIX) :]
            if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
                continue
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
