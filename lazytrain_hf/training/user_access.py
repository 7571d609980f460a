"""What the user's callbacks see and change between optimizer steps of a streamed model.

Owns two guarantees `transformers.Trainer` gives for free because its model *is* the trained state:

Note: [Callbacks see the updated weights]
    With ``optim_overlap_forward`` the layer-wise update runs on a background thread after `optimizer.step()` returns,
    while the next forward streams the layers already updated. A user callback reading the model at `on_step_end`
    (EMA, logging weight norms, clamping) saw the previous step's weights. Before an event is dispatched to a
    callback that is not the library's own (`user_overrides`: a class outside transformers / trl / peft /
    accelerate / lazytrain_hf that overrides the event), the update in flight is drained (`LayerwiseUpdater.wait_all`):
    the callback sees what Trainer's would. Overlap is lost for the steps where such a callback runs (every step for
    `on_step_end`, logging steps for `on_log`), kept otherwise. Test:
    ``tests/test_trainer_honoured.py::test_callbacks_see_the_updated_weights_with_overlap``.

Note: [In-place edits of weights are folded into the masters]
    Between steps a parameter of the model points at the device slot of a plan-resident layer, at the host compute
    copy of a streamed one (bf16 when an fp32 model computes in bf16) or at the device copy of a resident parameter;
    the optimizer updates the fp32 masters and rewrites those copies from them, so a callback's in-place edit
    (clamping, weight surgery, an EMA swap) was lost wherever the visible tensor is not the master itself. After one
    of the training-loop events (`EDIT_EVENTS`: step, substep, optimizer, epoch, train begin and end; not logging,
    evaluation, saving or prediction, which read) was dispatched to a user callback that defines it (`absorb_edits`),
    every visible weight is compared with its master converted to the visible dtype (the exact value the optimizer
    wrote: both round to nearest even): the elements that differ are the user's edits and are written into the
    master (and into the host compute copy when the visible tensor is a device slot), the others stay bit-exact. One pass over the weights (a device-to-host read of the
    resident ones) per such event. Units whose training state is on NVMe (``state_nvme_dir``) are not compared
    (their compute copy is read from their state file at each fetch). Tests:
    ``tests/test_trainer_honoured.py::test_callback_edits_to_weights_are_kept`` and
    ``::test_callback_reading_weights_changes_nothing``.

This module never imports `transformers.Trainer`; it takes the callback handler, the `StreamHandle` and the
`LayerwiseUpdater` as arguments.
"""

from __future__ import annotations

from typing import Any

import torch

# callbacks from these packages neither read nor edit weights between steps (progress, logging integrations,
# Trainer's own flow, TRL's and LazyTrain's): dispatching to them needs no drain
LIBRARY_PACKAGES = ("transformers", "trl", "peft", "accelerate", "lazytrain_hf")
# the events after which a user callback's in-place weight edits are folded into the masters (Note: [In-place edits
# of weights are folded into the masters]); the others (on_log, on_evaluate, on_save, on_predict, ...) only drain
EDIT_EVENTS = frozenset(
    {
        "on_train_begin",
        "on_epoch_begin",
        "on_step_begin",
        "on_substep_end",
        "on_pre_optimizer_step",
        "on_optimizer_step",
        "on_step_end",
        "on_epoch_end",
        "on_train_end",
    }
)


def _is_library(cls: type) -> bool:
    return cls.__module__.split(".")[0] in LIBRARY_PACKAGES


def user_overrides(callbacks: list[Any], event: str) -> bool:
    """Whether a callback in ``callbacks`` that is not the library's own defines ``event`` (Note: [Callbacks see the
    updated weights])."""
    from transformers import TrainerCallback

    base = getattr(TrainerCallback, event, None)
    for cb in callbacks:
        cls = type(cb)
        if _is_library(cls):
            continue
        impl = getattr(cls, event, None)
        if impl is not None and impl is not base:
            return True
    return False


def guard_callbacks(handler: Any, updater_of) -> None:
    """Wrap ``handler.call_event`` (a `CallbackHandler`) so that, while ``updater_of()`` returns a
    `LayerwiseUpdater`, an event dispatched to a user callback first drains the update in flight and afterwards (an
    `EDIT_EVENTS` event) folds the callback's in-place weight edits into the masters (Notes: [Callbacks see the updated weights], [In-place
    edits of weights are folded into the masters]). Idempotent."""
    if getattr(handler.call_event, "_lazytrain_guard", False):
        return
    inner = handler.call_event

    def call_event(event, args, state, control, **kwargs):
        updater = updater_of()
        if updater is None or not user_overrides(handler.callbacks, event):
            return inner(event, args, state, control, **kwargs)
        updater.wait_all()
        control = inner(event, args, state, control, **kwargs)
        if event in EDIT_EVENTS:
            absorb_edits(updater.handle, updater)
        return control

    call_event._lazytrain_guard = True
    handler.call_event = call_event


@torch.no_grad()
def _fold(visible: torch.Tensor, master: torch.Tensor) -> bool:
    """Write the elements of ``visible`` that differ from ``master`` rounded to ``visible``'s dtype into ``master``
    (fp32); returns whether any did."""
    seen = visible.detach().to("cpu").reshape(master.shape)
    edited = seen != master.to(seen.dtype)
    if not bool(edited.any()):
        return False
    master[edited] = seen[edited].to(master.dtype)
    return True


@torch.no_grad()
def absorb_edits(handle: Any, updater: Any) -> int:
    """Fold in-place edits of the model's weights made since the last optimizer step into the fp32 masters (and the
    host compute copies); returns how many tensors had edits. Note: [In-place edits of weights are folded into the
    masters]."""
    handle.synchronize()
    spill = getattr(handle, "nvme_state", None)
    changed = 0
    for key, ls in handle.store.layers.items():
        if spill is not None and key in spill.units:
            continue
        for e in ls.entries:
            visible = e.param.data
            host = ls.compute_views[e.name]
            on_host = visible.data_ptr() == host.data_ptr()
            edited = False
            if not on_host:  # a plan-resident layer's device slot: the host compute copy follows it
                seen = visible.to("cpu").reshape(host.shape)
                if not torch.equal(seen, host):
                    # Note: [Host compute copy is not rewritten while a fetch reads it] in streaming/engine.py
                    handle.engine.wait_host_reads(key)
                    host.copy_(seen)
                    edited = True
            if e.trainable and ls.master is not None and not ls.aliased:
                edited = _fold(host, ls.master_views[e.name]) or edited
            changed += edited
    for _, p, master in updater.resident:
        if master.data_ptr() != p.data_ptr():
            changed += _fold(p.data, master)
    return changed
