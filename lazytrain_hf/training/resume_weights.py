"""The weights of a checkpoint loaded on resume in the format `save_pretrained` wrote them.

Owns Note: [Checkpoint weights in the saved format]: `load_checkpoint_weights` (converted and copied in place, or
a model whose layers are on disk pointed at the checkpoint's files), `check_weights_cover` (the conversion run on
the file headers: every parameter covered) and `checkpoint_error` (the message of a checkpoint that cannot be read).
"""

from __future__ import annotations

import contextlib

import torch
from transformers.utils import logging

from ..loading import find_weight_files as _weight_files
from ..weight_layout import converted, group_by_target, is_pretrained, saved_names, weight_transforms

logger = logging.get_logger(__name__)


def checkpoint_error(checkpoint: str | None, e: BaseException) -> str:
    return (
        f"could not load checkpoint {checkpoint!r}: {e}. A file in it is corrupted or truncated; resume from an "
        f"earlier checkpoint (the checkpoint-<N> directories next to it) or start without resume_from_checkpoint."
    )


# Note: [Checkpoint weights in the saved format] `save_pretrained` writes the weights in the layout of the hub
# checkpoints (transformers' `revert_weight_conversion`), which need not be the model's own: the MoE families
# (qwen2_moe, qwen3_moe, qwen3_next, qwen3_5_moe_text) hold their experts fused (`mlp.experts.gate_up_proj`,
# `mlp.experts.down_proj`) and save them one tensor per expert (`mlp.experts.{i}.{gate,up,down}_proj.weight`).
# `from_pretrained` converts them back; Trainer's `_load_from_checkpoint` (`load_state_dict(strict=False)`) does not:
# the fused experts were reported "missing" and kept their initial values. A resume therefore converts the checkpoint
# with the transforms `from_pretrained` applies (transformers' conversion mapping for the model, the same ops in the
# same key order) and copies the result into the model's parameters in place, one converted target at a time;
# `check_weights_cover` runs the same conversion on the shapes of the file headers (meta tensors, no data read).
def load_checkpoint_weights(checkpoint_dir: str, model) -> bool:
    """Load the weights of the checkpoint in ``checkpoint_dir`` into ``model`` (in place), converted from the format
    `save_pretrained` wrote to the model's own parameter names and shapes (Note: [Checkpoint weights in the saved
    format]). Returns False, loading nothing, where no conversion applies (no safetensors weights, a model that is
    not a `PreTrainedModel` such as a PEFT wrapper, or no conversion mapping for its class): Trainer's own load is
    exact there. Raises ValueError where the weights do not cover the model (`check_weights_cover`) or a file cannot
    be read."""
    files = _weight_files(checkpoint_dir)
    if files is not None and is_pretrained(model) and _on_disk(model):
        _point_at_checkpoint(checkpoint_dir, model)
        return True
    if files is None or not is_pretrained(model) or not weight_transforms(model):
        return False
    try:
        problem = _coverage_problem(checkpoint_dir, files, model)
        if problem is None:
            _copy_converted(files, model)
    except Exception as e:
        raise ValueError(checkpoint_error(checkpoint_dir, e)) from e
    if problem is not None:
        raise ValueError(problem)
    return True


def _on_disk(model) -> bool:
    from ..streaming.store import has_disk_source

    return any(has_disk_source(p) for p in model.parameters())


def _point_at_checkpoint(checkpoint_dir: str, model) -> None:
    """Resume a model whose layers are still on disk (`lazytrain_hf.from_pretrained`): its meta parameters are
    pointed at the checkpoint's files (read layer by layer when the host store is built, converted as a resume
    converts them), the loaded ones are overwritten in place from it; nothing else is read."""
    from ..loading import ShardedWeights
    from ..streaming.store import DISK_ATTR, DiskSource, disk_source

    check_weights_cover(checkpoint_dir, model)
    try:
        weights = ShardedWeights(checkpoint_dir, model)
    except Exception as e:
        raise ValueError(checkpoint_error(checkpoint_dir, e)) from e
    source = DiskSource(weights.read, description=checkpoint_dir)
    loaded = []
    for name, p in model.named_parameters():
        ds = disk_source(p)
        if ds is not None:
            setattr(p, DISK_ATTR, (source, ds[1]))
        else:
            loaded.append((name, p))
    with torch.no_grad():
        for name, p in loaded:
            if name in weights.keys_of:
                p.copy_(weights.read([name])[name])
        for name, b in model.named_buffers():
            if name in weights.keys_of:
                b.copy_(weights.read([name])[name])
    model.lazytrain_weights = weights


def check_weights_cover(checkpoint_dir: str, model) -> None:
    """Raise ValueError naming the checkpoint, the model's parameters its weights leave uncovered (or give another
    shape) once converted as a resume converts them, the keys the model would have saved that are absent, and the
    fix. Reads only the file headers; nothing to check without safetensors weights or for a model that is not a
    `PreTrainedModel` (a PEFT checkpoint holds the adapters only)."""
    files = _weight_files(checkpoint_dir)
    if files is None or not is_pretrained(model):
        return
    problem = _coverage_problem(checkpoint_dir, files, model)
    if problem is not None:
        raise ValueError(problem)


def _coverage_problem(checkpoint_dir: str, files: list[str], model) -> str | None:
    """What `check_weights_cover` reports, or None: the checkpoint's keys converted on meta tensors of their shapes."""
    from safetensors import safe_open
    from transformers.core_model_loading import dot_natural_key, revert_weight_conversion

    sources = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                sources[key] = torch.empty(f.get_slice(key).get_shape(), device="meta")
    groups, _ = group_by_target(model, sources)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    covered, unfit = set(), {}
    for target, group in groups.items():
        try:
            out = converted(model, group, target)
        except Exception as e:  # e.g. gate and up projections of different expert counts
            unfit[target] = f"conversion failed: {type(e).__name__}: {e}"
            continue
        for name, t in out.items():
            if name in shapes and tuple(t.shape) != shapes[name]:
                unfit[name] = f"shape {tuple(t.shape)} from the checkpoint, {shapes[name]} in the model"
            else:
                covered.add(name)
    saved = saved_names(model)
    missing = sorted(saved - covered - set(unfit), key=dot_natural_key)
    if not missing and not unfit:
        return None
    # the keys this model writes (`revert_weight_conversion` on meta tensors) that the checkpoint lacks
    meta = {n: torch.empty(shapes[n], device="meta") for n in saved}
    absent = sorted(set(revert_weight_conversion(model, meta)) - set(sources), key=dot_natural_key)
    parts = []
    if missing:
        parts.append(f"{len(missing)} parameter(s) of the model are missing: {', '.join(missing[:5])}")
    if unfit:
        parts.append(f"{len(unfit)} do not fit: " + "; ".join(f"{n} ({why})" for n, why in list(unfit.items())[:3]))
    if absent:
        parts.append(f"it lacks {len(absent)} key(s) this model saves: {', '.join(absent[:5])}")
    return (
        f"checkpoint {checkpoint_dir} does not hold all of the model's weights once converted as a resume converts "
        f"them (transformers' conversion mapping for {type(model).__name__}): {'; '.join(parts)}. It was written "
        "for another model (architecture, expert count) or is incomplete; resume from a checkpoint of this model "
        "(an earlier checkpoint-<N> directory) or start without resume_from_checkpoint."
    )


def _copy_converted(files: list[str], model) -> None:
    """Copy the checkpoint's tensors, converted one target at a time (each read from the file when converted), into
    the model's parameters and buffers in place: their objects (tied weights, optimizer references) are kept."""
    from functools import partial

    from safetensors import safe_open

    def read(sl):
        return sl[...]

    with contextlib.ExitStack() as stack:
        sources = {}
        for path in files:
            f = stack.enter_context(safe_open(path, framework="pt"))
            sources.update({key: partial(read, f.get_slice(key)) for key in f.keys()})
        groups, unexpected = group_by_target(model, sources)
        if unexpected:
            logger.warning(f"There were unexpected keys in the checkpoint model loaded: {unexpected}.")
        targets = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for target, group in groups.items():
                for name, t in converted(model, group, target).items():
                    if name in targets:
                        targets[name].copy_(t)
