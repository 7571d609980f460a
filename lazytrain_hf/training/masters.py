"""The fp32 masters a checkpoint carries besides the weights (Note: [fp32 masters in checkpoints]).

Owns `MASTER_FILE`, `separate_masters` (the masters that are not the model's own weights: views of the host store and
the optimizer's resident masters), `unsaved_masters` (the same once the optimizer step in flight has finished) and
`restore_masters` (the masters file copied back into the host store or the resident masters on resume).
"""

from __future__ import annotations

import os

import torch

from .lazytensor import LazyTensor
from .partition_files import PartitionIndex

MASTER_FILE = "lazytrain_master.safetensors"


def separate_masters(handle, updater, store: bool = True, resident: bool = True) -> dict[str, torch.Tensor]:
    """The fp32 masters that are not the model's own weights (their compute copy is bf16/fp16), by name: views of
    the host store's masters (``handle``, a `StreamHandle` or None) and the resident masters of ``updater`` (a
    `LayerwiseUpdater` or None).

    Note: [fp32 masters in checkpoints] the weights of a checkpoint are the compute copy; resuming from them alone
    would restart from masters rounded to the compute dtype. Checkpoints therefore carry these masters too.
    """
    out: dict[str, torch.Tensor] = {}
    if store and handle is not None:
        spill = getattr(handle, "nvme_state", None)
        for key, ls in handle.store.layers.items():
            if spill is not None and key in spill.units:
                if not ls.aliased:  # their masters are in the state files: read one by one when written
                    for e in ls.trainable_entries:
                        out[e.name] = LazyTensor(
                            torch.float32,
                            tuple(e.shape),
                            lambda k=key, n=e.name, s=e.shape: spill.read_param(k, n, "master").view(s),
                        )
                continue
            if ls.master is not None and not ls.aliased:
                out.update(ls.master_views)
    if resident and updater is not None:
        out.update({n: m for n, p, m in updater.resident if m.data_ptr() != p.data_ptr()})
    return out


def unsaved_masters(handle, updater) -> dict[str, torch.Tensor]:
    """`separate_masters()` (views of the host store, not copies: Note: [Checkpoints are streamed from the host
    store]) once the optimizer step in flight (if any) has finished. Nothing updates them until the save is over:
    the next optimizer step runs after it."""
    if updater is not None:
        updater.wait_all()
    return {n: t if isinstance(t, LazyTensor) else t.detach() for n, t in separate_masters(handle, updater).items()}


def restore_masters(checkpoint: str | None, handle, updater, where: str, in_weights=frozenset()) -> None:
    """Copy the checkpoint's fp32 masters into the host store (`where="store"`, right after attach) or into the
    optimizer's resident masters (`where="resident"`, when the optimizer is built). Names in ``in_weights`` (masters
    the weights file holds in their own dtype: Note: [A checkpoint holds the model in its own dtype]) are restored
    from the masters file only when it has them (a checkpoint written before)."""
    path = os.path.join(checkpoint, MASTER_FILE) if checkpoint else None
    # Note: [A checkpoint of a partitioned state] in training/partition_files.py: the masters of units are in the
    # partition of the rank that owned them
    parts = PartitionIndex(checkpoint)
    if path is None or (not os.path.exists(path) and not parts):
        return
    from safetensors.torch import load_file

    saved = load_file(path) if os.path.exists(path) else {}
    targets = separate_masters(handle, updater, store=where == "store", resident=where == "resident")
    spill = getattr(handle, "nvme_state", None) if handle is not None else None
    units = {e.name: k for k, ls in handle.store.layers.items() for e in ls.entries} if spill is not None else {}
    with torch.no_grad():
        for name, dst in targets.items():
            if name not in saved and parts.has_master(name):
                saved[name] = parts.master(name)
            if name not in saved and name in in_weights:
                continue  # loaded with the weights, in fp32
            if name not in saved or tuple(saved[name].shape) != tuple(dst.shape):
                raise ValueError(
                    f"checkpoint file {path} has no fp32 master of shape {tuple(dst.shape)} for {name!r}; it was "
                    "written for another model. Resume from a checkpoint of this model."
                )
            if isinstance(dst, LazyTensor):
                spill.write_param(units[name], name, "master", saved[name])  # into the committed state file
            else:
                dst.copy_(saved[name])
