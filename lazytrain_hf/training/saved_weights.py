"""The weights a checkpoint of a streamed model holds: the model as the user loaded it, not the executor's copies.

Note: [A checkpoint holds the model in its own dtype]
    With ``bf16=True`` an fp32 model computes with a bf16 copy (the host compute copy, bf16 resident parameters) and
    keeps its fp32 masters on the host; while the executor is attached, ``model.state_dict()`` is that bf16 copy.
    Checkpoints were written from it: an fp32 model's ``model.safetensors`` held bf16 weights, and
    ``load_best_model_at_end`` loaded their rounding (3.7e-3 off the masters) while Trainer's checkpoints of the same
    fp32 model hold fp32. `cast_overrides` gives, for every parameter whose compute copy has another dtype than the
    model's own, the value `StreamHandle.remove` would give it back (Note: [A bf16 compute copy of an fp32 model] in
    streaming/hooks.py): the fp32 master of a trainable parameter, the compute copy converted back for a frozen one,
    the kept fp32 tensor of a resident one, read from the state file for units whose state is on NVMe. The
    checkpoint writer (`checkpoints.write_model_weights`) writes them in place of the state dict's values, so the
    weights file holds what Trainer's would and a resume or the best model loads the masters bit for bit; those
    masters are then left out of ``lazytrain_master.safetensors`` (`checkpoints.restore_masters` skips them).
    Test: ``tests/test_trainer_honoured.py::test_bf16_compute_of_fp32_model_checkpoints_and_best_model_from_masters``.

This module never imports `transformers.Trainer`; it reads the `StreamHandle` it is given and writes nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from .lazytensor import LazyTensor


def cast_overrides(handle: Any) -> dict[str, torch.Tensor | LazyTensor]:
    """By parameter name, the value to save for each parameter of ``handle``'s model whose compute copy is another
    dtype than its own (Note: [A checkpoint holds the model in its own dtype]); empty without a compute dtype."""
    out: dict[str, torch.Tensor | LazyTensor] = {}
    if handle is None or getattr(handle, "compute_dtype", None) is None:
        return out
    spill = getattr(handle, "nvme_state", None)
    for key, ls in handle.store.layers.items():
        on_nvme = spill is not None and key in spill.units
        for e in ls.entries:
            if e.orig_dtype is None or e.orig_dtype == e.dtype:
                continue
            if on_nvme:
                out[e.name] = LazyTensor(
                    e.orig_dtype,
                    tuple(e.shape),
                    lambda n=e.name: spill.read_values([n], restored=True)[n],
                )
            elif e.trainable and ls.master is not None:
                out[e.name] = ls.master_views[e.name].view(e.shape)  # fp32: written from the store, no copy
            else:
                view = ls.compute_views[e.name]
                out[e.name] = LazyTensor(e.orig_dtype, tuple(e.shape), lambda v=view, d=e.orig_dtype: v.to(d))
    for name, original in getattr(handle, "resident_fp32", {}).items():
        out[name] = original  # the optimizer's master of a trainable one (`LayerwiseUpdater`), else untouched
    return out
