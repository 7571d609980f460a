"""A model's weights written as `save_pretrained` writes them, one decoder layer at a time from the host store.

Owns Note: [Checkpoints are streamed from the host store]: `write_model_weights` (names, format, sharding, index;
each layer's tensors read from RAM, a `DiskSource` or the state on NVMe and converted when written),
`save_streamed` (`save_pretrained` with those weights) and `streams_weights` (whether it applies).
"""

from __future__ import annotations

import json
import math
import os

import torch

from ..loading import WEIGHTS_FILE, WEIGHTS_INDEX_FILE
from ..weight_layout import is_pretrained, saved_names
from .lazytensor import LazyTensor
from .safetensors_writer import SafetensorsWriter
from .staging import atomic_write_text

# ---------------------------------------------------------------------- streamed safetensors
# Note: [Checkpoints are streamed from the host store]
#     `save_pretrained` (and `safetensors.torch.save_file`) build each shard's bytes in memory before writing: a
#     second copy of the whole model in RAM during every save, and the fp32 masters were cloned besides. A streamed
#     run writes its weights with `write_model_weights` instead: the header of every file is computed first from the
#     shapes and dtypes (the saved names and format come from transformers' `revert_weight_conversion` applied to meta
#     tensors, one decoder layer at a time, so MoE experts are saved per expert as `save_pretrained` saves them), then
#     each layer's tensors are converted and written straight from the host store's views, one layer at a time; the
#     only transient is what one layer's conversion materialises (plus one resident tensor copied off the device).
#     The files are the same as `save_pretrained`'s: `model.safetensors` or shards with `model.safetensors.index.json`
#     (`metadata.format = "pt"`), read back by Trainer's resume, `load_checkpoint_weights` and `verify_checkpoint`.


def save_streamed(
    model, output_dir: str, max_shard_size: int | str = "50GB", read=None, overrides: dict | None = None
) -> None:
    """`save_pretrained` of a streamed ``model`` with its weights written by `write_model_weights` (Note:
    [Checkpoints are streamed from the host store]): `save_pretrained` writes everything but the weights (config,
    generation config, custom code) from an empty state dict, then the weights replace its empty weights file."""
    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir, state_dict={}, is_main_process=True, max_shard_size=max_shard_size)
    write_model_weights(model, output_dir, max_shard_size=max_shard_size, read=read, overrides=overrides)


def streams_weights(model) -> bool:
    """`save_streamed` applies: a `PreTrainedModel` (a PEFT model saves its adapters only, through its own
    `save_pretrained`)."""
    return is_pretrained(model)


def _weight_groups(model) -> list[list[str]]:
    """The model's saved state-dict names grouped for conversion and writing: one group per decoder layer (every
    key under ``<layers>.<i>.``), every other key alone; in state-dict order."""
    import re

    from .. import models

    saved = saved_names(model)
    prefix = None
    try:
        spec = models.get_spec(model)
        prefix = spec.layers + "."
    except Exception:  # not a supported model: one group per key
        prefix = None
    groups: dict[str, list[str]] = {}
    for name in model.state_dict():
        if name not in saved:
            continue
        key = name
        if prefix is not None and name.startswith(prefix):
            m = re.match(r"(\d+)\.", name[len(prefix) :])
            if m:
                key = prefix + m.group(1)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _converted_group(model, sd: dict[str, torch.Tensor], names: list[str]) -> list[tuple[str, torch.Tensor]]:
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(model, {n: sd[n] for n in names})
    return list(out.items())


def _group_values(
    sd: dict[str, torch.Tensor], names: list[str], params: dict[str, torch.Tensor], read=None, overrides=None
) -> dict[str, torch.Tensor]:
    """``sd`` with the group's values that are not in RAM read now (one layer at a time): parameters left on disk
    (a `DiskSource`), and what ``read(names)`` returns (the units whose state is on NVMe during training)."""
    from ..streaming.store import disk_source

    out = dict(sd)
    got = read(names) if read is not None else {}
    out.update(got)
    by_source: dict[int, tuple] = {}
    for n in names:
        ds = disk_source(params[n]) if n in params and n not in got else None
        if ds is not None:
            by_source.setdefault(id(ds[0]), (ds[0], []))[1].append((n, ds[1]))
    for source, pairs in by_source.values():
        vals = source.read([key for _, key in pairs])
        for n, key in pairs:
            out[n] = vals[key]
    for n in names:  # Note: [A checkpoint holds the model in its own dtype] in training/saved_weights.py
        if overrides and n in overrides:
            v = overrides[n]
            out[n] = v.read() if isinstance(v, LazyTensor) else v
    return out


def write_model_weights(
    model, output_dir: str, max_shard_size: int | str = "50GB", read=None, overrides: dict | None = None
) -> list[str]:
    """Write ``model``'s weights as `save_pretrained` would (names, format, sharding, index) into ``output_dir``,
    one decoder layer at a time from wherever each parameter lives (Note: [Checkpoints are streamed from the host
    store]): RAM, a `DiskSource`, or ``read(names)`` (values the caller supplies, e.g. `NvmeState.read_values`).
    ``overrides``: values (tensors or `LazyTensor`) written instead of the state dict's, in their own dtype (Note:
    [A checkpoint holds the model in its own dtype] in training/saved_weights.py). Returns the files written."""
    from huggingface_hub.serialization._base import parse_size_to_int

    limit = parse_size_to_int(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    sd = model.state_dict()
    for n, v in (overrides or {}).items():
        if n in sd:  # dtype and shape for the header; the value is read when its group is written
            sd[n] = torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, LazyTensor) else v
    params = dict(model.named_parameters(remove_duplicate=False))
    groups = _weight_groups(model)
    # pass 1: names, dtypes and shapes of what each group writes (the conversion on meta tensors)
    planned: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = []
    for names in groups:
        meta = {n: torch.empty(sd[n].shape, dtype=sd[n].dtype, device="meta") for n in names}
        planned.append([(k, t.dtype, tuple(t.shape)) for k, t in _converted_group(model, meta, names)])
    # shards: groups packed in order, a new shard when the next group would pass the limit (a group is never split)
    shards: list[list[int]] = [[]]
    size = 0
    for gi, specs in enumerate(planned):
        nbytes = sum(math.prod(sh) * dt.itemsize for _, dt, sh in specs)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(gi)
        size += nbytes
    n = len(shards)
    names_of = [WEIGHTS_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    for stale in (WEIGHTS_FILE, WEIGHTS_INDEX_FILE):
        if stale not in names_of and os.path.exists(os.path.join(output_dir, stale)):
            os.remove(os.path.join(output_dir, stale))
    weight_map: dict[str, str] = {}
    total = 0
    for fname, members in zip(names_of, shards):
        specs = [spec for gi in members for spec in planned[gi]]
        w = SafetensorsWriter(os.path.join(output_dir, fname), specs, {"format": "pt"})
        try:
            for gi in members:
                vals = _group_values(sd, groups[gi], params, read, overrides)
                for key, t in _converted_group(model, vals, groups[gi]):  # one layer materialised at a time
                    w.write(key, t)
                    weight_map[key] = fname
                    total += t.numel() * t.element_size()
        finally:
            w._f.close()
        w.close()
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write_text(os.path.join(output_dir, WEIGHTS_INDEX_FILE), json.dumps(index, indent=2, sort_keys=True))
    return [os.path.join(output_dir, f) for f in names_of]
