"""The optimizer state of units whose state is on NVMe, in a checkpoint (Note: [Checkpoints of the state on NVMe]).

Owns `NVME_STATE_FILE`, `write_nvme_optimizer_state` and `restore_nvme_optimizer_state`.
"""

from __future__ import annotations

import json
import os

import torch

from .lazytensor import LazyTensor
from .safetensors_writer import write_safetensors

# Note: [Checkpoints of the state on NVMe]
#     The optimizer state of units whose state is on NVMe is not in `HybridAdamW8bit.state` (their masters there are
#     placeholders), so Trainer's ``optimizer.pt`` lacks it. `write_nvme_optimizer_state` writes it next to it, one
#     tensor at a time from the committed state files, as `NVME_STATE_FILE` (per parameter ``<name>.exp_avg_codes``,
#     ``.exp_avg_absmax``, ``.exp_avg_sq_codes``, ``.exp_avg_sq_absmax``, or ``.exp_avg`` / ``.exp_avg_sq`` below
#     ``min_8bit_size``; the step counts in the metadata). `restore_nvme_optimizer_state` puts it back: into the
#     state files when the resumed run keeps those units on NVMe, else into the optimizer's state; and the state a
#     checkpoint of a run in RAM holds for units now on NVMe goes into their files. Test:
#     ``tests/test_state_nvme.py::test_resume_with_state_on_nvme``.
NVME_STATE_FILE = "lazytrain_nvme_optimizer.safetensors"
_NVME_ARRAYS = {
    "m_codes": "exp_avg_codes",
    "m_abs": "exp_avg_absmax",
    "v_codes": "exp_avg_sq_codes",
    "v_abs": "exp_avg_sq_absmax",
}


def write_nvme_optimizer_state(directory: str, handle) -> None:
    """Write the committed optimizer state of the units on NVMe into ``directory`` (Note: [Checkpoints of the state
    on NVMe]); nothing without such units."""
    spill = getattr(handle, "nvme_state", None) if handle is not None else None
    if spill is None or not spill.units:
        return
    tensors: list[tuple[str, object]] = []
    steps: dict[str, int] = {}
    for key, u in sorted(spill.units.items()):
        for p in u.params:
            steps[p.name] = p.step
            if p.q8:
                for what, suffix in _NVME_ARRAYS.items():
                    n = p.numel if what.endswith("codes") else p.nblk
                    dt = torch.uint8 if what.endswith("codes") else torch.float32
                    tensors.append(
                        (
                            f"{p.name}.{suffix}",
                            LazyTensor(dt, (n,), lambda k=key, nm=p.name, w=what: spill.read_param(k, nm, w)),
                        )
                    )
            else:
                for what in ("exp_avg", "exp_avg_sq"):
                    tensors.append((f"{p.name}.{what}", spill.read_param(key, p.name, what)))
    meta = {"format": "pt", "steps": json.dumps(steps), "block_size": str(spill.block_size)}
    write_safetensors(os.path.join(directory, NVME_STATE_FILE), tensors, meta)


def restore_nvme_optimizer_state(checkpoint: str | None, handle, updater, optimizer) -> None:
    """Note: [Checkpoints of the state on NVMe]: the checkpoint's optimizer state of units on NVMe, wherever the
    resumed run keeps it."""
    if checkpoint is None or handle is None or updater is None:
        return
    from safetensors import safe_open

    from ..optim.quant import Quantized8bit

    spill = getattr(handle, "nvme_state", None)
    path = os.path.join(checkpoint, NVME_STATE_FILE)
    masters = {}
    for i, entries in updater.layers.items():
        for name, m, _ in entries:
            masters[name] = (i, m)
    if spill is not None:
        # a checkpoint of a run in RAM: the optimizer.pt state of units now on NVMe goes into their files
        for name, (i, m) in masters.items():
            if i in spill.units and optimizer.state.get(m):
                st = optimizer.state.pop(m)
                for what, key in (("m", "exp_avg"), ("v", "exp_avg_sq")):
                    q = st[key]
                    if isinstance(q, Quantized8bit):
                        spill.write_param(i, name, f"{what}_codes", q.codes)
                        spill.write_param(i, name, f"{what}_abs", q.absmax)
                    else:
                        spill.write_param(i, name, key, q)
                spill.set_steps(i, {name: int(st["step"])})
    if not os.path.exists(path):
        return
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        steps = json.loads(meta.get("steps", "{}"))
        block = int(meta.get("block_size", 256))
        keys = set(f.keys())
        # units another rank owns (Note: [A checkpoint of a partitioned state] in training/partition_files.py)
        remote = {e.name for ls in handle.store.layers.values() if ls.remote for e in ls.entries}
        for name, step in steps.items():
            if name in remote:
                continue
            if name not in masters:
                raise ValueError(
                    f"checkpoint file {path} holds optimizer state for {name!r}, which this model does not train "
                    "as a streamed parameter; resume from a checkpoint of this model and setup."
                )
            i, m = masters[name]
            q8 = f"{name}.exp_avg_codes" in keys
            if spill is not None and i in spill.units:
                if q8:
                    for what, suffix in _NVME_ARRAYS.items():
                        spill.write_param(i, name, what, f.get_tensor(f"{name}.{suffix}"))
                else:
                    for what in ("exp_avg", "exp_avg_sq"):
                        spill.write_param(i, name, what, f.get_tensor(f"{name}.{what}"))
                spill.set_steps(i, {name: int(step)})
                continue
            st = optimizer.state[m]
            st["step"] = int(step)
            if q8:
                st["exp_avg"] = Quantized8bit(
                    f.get_tensor(f"{name}.exp_avg_codes"), f.get_tensor(f"{name}.exp_avg_absmax"), block, True
                )
                st["exp_avg_sq"] = Quantized8bit(
                    f.get_tensor(f"{name}.exp_avg_sq_codes"), f.get_tensor(f"{name}.exp_avg_sq_absmax"), block, False
                )
            else:
                st["exp_avg"] = f.get_tensor(f"{name}.exp_avg").view(m.shape)
                st["exp_avg_sq"] = f.get_tensor(f"{name}.exp_avg_sq").view(m.shape)
