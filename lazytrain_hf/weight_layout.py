"""The layout of a model's weights on disk against its own parameters: which saved tensors convert to which parameter.

`save_pretrained` writes the weights in the layout of the hub checkpoints (transformers' `revert_weight_conversion`),
which need not be the model's own (MoE experts saved one tensor per expert, held fused). This module owns the
conversion back, as `from_pretrained` applies it: the transforms of a model (`weight_transforms`), the saved tensors
grouped by the parameter they convert to (`group_by_target`), one group converted (`converted`), and the names a
model saves (`saved_names`). Used by loading a model whose layers stay on disk (`lazytrain_hf.loading`), by the
resume of a checkpoint (`training/resume_weights.py`) and by the streamed weight writer (`training/weight_files.py`).
Functions take the model and plain dicts; this module imports nothing of the package.
"""

from __future__ import annotations

import torch


def is_pretrained(model) -> bool:
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def weight_transforms(model) -> list:
    """The weight transforms `from_pretrained` applies to ``model``'s checkpoints: the ones it recorded when it loaded
    the model, else transformers' conversion mapping for the model's class (as `revert_weight_conversion` picks the
    ones it reverts on save), legacy renamings excluded (never applied on save)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(model, add_legacy=False)


def group_by_target(model, sources: dict) -> tuple[dict, list[str]]:
    """Checkpoint tensors (or callables reading them) by the model parameter they convert to, as
    `convert_and_load_state_dict_in_model` collects them: one `WeightConverter` or `WeightRenaming` per target, its
    sources in natural key order (expert 10 after expert 9). Also the names that match nothing in the model."""
    from copy import deepcopy

    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    transforms = weight_transforms(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    expected = model.state_dict()
    groups: dict = {}
    unexpected: list[str] = []
    for key in sorted(sources, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
        if name not in expected and key in expected:
            name, pattern = key, None
        if name not in expected:
            unexpected.append(name)
        elif pattern is None:
            groups.setdefault(name, WeightRenaming(key, name)).add_tensor(name, key, key, sources[key])
        else:
            groups.setdefault(name, deepcopy(by_pattern[pattern])).add_tensor(name, key, pattern, sources[key])
    return groups, unexpected


def converted(model, group, target: str) -> dict[str, torch.Tensor]:
    """The model tensors ``group`` (a `WeightConverter` or `WeightRenaming` of `group_by_target`) converts to for
    ``target``, by name (one tensor each)."""
    out = group.convert(target, model=model, config=model.config)
    return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


def saved_names(model) -> set[str]:
    """The names of the parameters and buffers ``model`` saves (tied copies and `_keys_to_ignore_on_save` left
    out, as `save_pretrained` leaves them out)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    # on meta tensors (tied weights found by parameter identity): with real tensors it clones every parameter that
    # shares a storage without being tied, i.e. every view of the host store (Note: [Checkpoints are streamed from
    # the host store])
    meta = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in model.state_dict().items()}
    names = set(remove_tied_weights_from_state_dict(meta, model))
    return names - set(model._keys_to_ignore_on_save or ())
