"""What a LazyTrain run writes to disk and reads back, besides what `transformers.Trainer` itself saves.

Owns the checkpoint protocol on disk: staging directories renamed into place (Note: [Atomic checkpoints]), the fp32
masters file (Note: [fp32 masters in checkpoints]), the plan next to the weights (`write_plan` / `read_plan`), the
check of every file a resume reads (`verify_checkpoint`), which checkpoint a resume means (`resolve_checkpoint`) and
the model card section. Functions take directories, plans and the executor's objects (`StreamHandle`,
`LayerwiseUpdater`) as arguments: this module never imports `transformers.Trainer`, never writes weights,
optimizer or scheduler files (Trainer's `_save_checkpoint` does, into the staging directory) and moves nothing
between host and device.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import torch

from ..args import PLAN_FILE
from ..units import format_bytes

MASTER_FILE = "lazytrain_master.safetensors"

# Note: [Atomic checkpoints] a checkpoint is written into ``<run_dir>/.staging-<pid>/checkpoint-<N>`` and renamed into
# place once complete (`publish_checkpoint`), so an interrupted save never replaces a good checkpoint with a
# half-written one. `get_last_checkpoint` only matches `checkpoint-<N>`; a staging directory left by a killed process
# is never taken as the latest checkpoint and is removed by the next save (`remove_stale_staging`).
STAGING_PREFIX = ".staging-"


# ---------------------------------------------------------------------- writing
def staging_dir(run_dir: str) -> str:
    """This process's staging directory under ``run_dir`` (Note: [Atomic checkpoints])."""
    return os.path.join(run_dir, f"{STAGING_PREFIX}{os.getpid()}")


def publish_checkpoint(staging_root: str, final: str, masters: dict[str, torch.Tensor]) -> None:
    """Complete the checkpoint staged in ``staging_root/<basename of final>`` with the fp32 ``masters`` (if any),
    flush every file and rename it to ``final``, replacing a checkpoint of the same step (Note: [Atomic
    checkpoints]); ``staging_root`` is removed."""
    staged = os.path.join(staging_root, os.path.basename(final))
    if masters:
        from safetensors.torch import save_file

        save_file(masters, os.path.join(staged, MASTER_FILE))
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


def write_plan(plan, directory: str) -> None:
    """Write ``plan`` as ``directory``/lazytrain_plan.json (atomically)."""
    os.makedirs(directory, exist_ok=True)
    atomic_write_text(os.path.join(directory, PLAN_FILE), plan.to_json())


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


# ---------------------------------------------------------------------- fp32 masters
def separate_masters(handle, updater, store: bool = True, resident: bool = True) -> dict[str, torch.Tensor]:
    """The fp32 masters that are not the model's own weights (their compute copy is bf16/fp16), by name: views of
    the host store's masters (``handle``, a `StreamHandle` or None) and the resident masters of ``updater`` (a
    `LayerwiseUpdater` or None).

    Note: [fp32 masters in checkpoints] the weights of a checkpoint are the compute copy; resuming from them alone
    would restart from masters rounded to the compute dtype. Checkpoints therefore carry these masters too.
    """
    out: dict[str, torch.Tensor] = {}
    if store and handle is not None:
        for ls in handle.store.layers.values():
            if ls.master is not None and not ls.aliased:
                out.update(ls.master_views)
    if resident and updater is not None:
        out.update({n: m for n, p, m in updater.resident if m.data_ptr() != p.data_ptr()})
    return out


def unsaved_masters(handle, updater) -> dict[str, torch.Tensor]:
    """Copies of `separate_masters()` once the optimizer step in flight (if any) has finished."""
    if updater is not None:
        updater.wait_all()
    return {n: t.detach().contiguous().clone() for n, t in separate_masters(handle, updater).items()}


def restore_masters(checkpoint: str | None, handle, updater, where: str) -> None:
    """Copy the checkpoint's fp32 masters into the host store (`where="store"`, right after attach) or into the
    optimizer's resident masters (`where="resident"`, when the optimizer is built)."""
    path = os.path.join(checkpoint, MASTER_FILE) if checkpoint else None
    if path is None or not os.path.exists(path):
        return
    from safetensors.torch import load_file

    saved = load_file(path)
    targets = separate_masters(handle, updater, store=where == "store", resident=where == "resident")
    with torch.no_grad():
        for name, dst in targets.items():
            if name not in saved or saved[name].shape != dst.shape:
                raise ValueError(
                    f"checkpoint file {path} has no fp32 master of shape {tuple(dst.shape)} for {name!r}; it was "
                    "written for another model. Resume from a checkpoint of this model."
                )
            dst.copy_(saved[name])


# ---------------------------------------------------------------------- reading
def resolve_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint directory ``resume_from_checkpoint`` names (True: the last one in ``output_dir``), or None."""
    from transformers.trainer_utils import get_last_checkpoint

    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        last = get_last_checkpoint(output_dir)
        if last is None:
            raise ValueError(
                f"resume_from_checkpoint=True but no checkpoint-<N> directory is in output_dir="
                f"{output_dir!r}; pass a checkpoint path or start without resuming."
            )
        return last
    if not os.path.isdir(resume_from_checkpoint):
        raise ValueError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} is not a directory; pass a checkpoint-<N> path."
        )
    return str(resume_from_checkpoint)


def checkpoint_error(checkpoint: str | None, e: BaseException) -> str:
    return (
        f"could not load checkpoint {checkpoint!r}: {e}. A file in it is corrupted or truncated; resume from an "
        f"earlier checkpoint (the checkpoint-<N> directories next to it) or start without resume_from_checkpoint."
    )


def verify_checkpoint(checkpoint_dir: str) -> None:
    """Open every file a resume reads (weights, optimizer, scheduler and RNG states, trainer state, plan) without
    loading it into the model; a corrupted or truncated one raises ValueError naming the file. (`training_args.bin`
    is written by Trainer for reference only and never read back.)"""
    from safetensors import safe_open

    from ..planner.plan import Plan

    for name in sorted(os.listdir(checkpoint_dir)):
        path = os.path.join(checkpoint_dir, name)
        try:
            if name.endswith(".safetensors"):
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        f.get_slice(key)  # header and offsets are checked against the file size
                size = os.path.getsize(path)
                with open(path, "rb") as fh:
                    header_len = int.from_bytes(fh.read(8), "little")
                    header = json.loads(fh.read(header_len))
                end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
                if 8 + header_len + end != size:
                    raise ValueError(f"size {size} bytes, header describes {8 + header_len + end}")
            elif name in ("optimizer.pt", "scheduler.pt", "scaler.pt") or (
                name.startswith("rng_state") and name.endswith(".pth")
            ):
                from transformers.trainer_pt_utils import safe_globals

                with safe_globals():  # the numpy RNG types Trainer's rng_state.pth holds, as Trainer loads it
                    torch.load(path, map_location="cpu", weights_only=True)
            elif name == PLAN_FILE:
                Plan.from_json(path)
            elif name.endswith(".json"):
                with open(path) as fh:
                    json.load(fh)
        except Exception as e:
            raise ValueError(
                f"checkpoint file {path} is corrupted or truncated ({type(e).__name__}: {e}); resume from an "
                f"earlier checkpoint-<N> directory or delete this one."
            ) from e


def read_plan(checkpoint_dir: str):
    """The plan saved with a checkpoint (or None). Corrupted files raise an error naming the file."""
    from ..planner.plan import Plan

    path = os.path.join(checkpoint_dir, PLAN_FILE)
    if not os.path.exists(path):
        return None
    return Plan.from_json(path)


# ---------------------------------------------------------------------- model card
def lazytrain_card_section(plan, log_history: list[dict]) -> str:
    """Model-card section: the plan that trained the model and the throughput measured while training."""
    measured = [h for h in log_history if "tokens_per_s" in h]
    last = measured[-1] if measured else {}
    lines = [
        "## LazyTrain",
        "",
        "Trained with lazytrain_hf (layer streaming, planned activations, Hybrid 8-bit).",
        "",
        "```",
        plan.table(),
        "```",
        "",
    ]
    if last:
        lines.append(
            f"Measured: {last['tokens_per_s']:.1f} tokens/s, {last.get('tflops', 0.0):.3f} TFLOPS, "
            f"peak device memory {format_bytes(last.get('peak_device_bytes'))}."
        )
    return "\n".join(lines)


def append_card_section(card_path: str, plan, log_history: list[dict]) -> None:
    """Append `lazytrain_card_section` to the model card at ``card_path`` (nothing when there is no card)."""
    if not os.path.exists(card_path):
        return
    with open(card_path) as f:
        card = f.read()
    card += "\n" + lazytrain_card_section(plan, log_history) + "\n"
    atomic_write_text(card_path, card)
