"""`from_pretrained`: a HF causal-LM whose decoder-layer weights stay on disk until the host store reads them.

`from_pretrained(name_or_path)` resolves a local directory or a Hub repository (``huggingface_hub.snapshot_download``,
safetensors files only), builds the model from its config with meta parameters (``accelerate.init_empty_weights``,
buffers real), loads what is not in a decoder layer (embeddings, final norm, lm_head, persistent buffers: needed
resident or small), and marks every decoder-layer parameter with the `DiskSource` that reads it
(``lazytrain_hf.streaming.store``). `attach` then builds the host store layer by layer, each layer read from the
shards (``safetensors.safe_open``, opened for that read only) straight into the layer's flat buffers, so no step holds
the whole model in RAM (Note: [A layer is read from disk into its buffers] in streaming/store.py).

Checkpoint keys are converted to the model's names and layout with transformers' conversion mapping, one target at a
time (the same transforms `from_pretrained` applies, e.g. MoE experts saved per expert fused into
``experts.gate_up_proj``; training/resume_weights.py, Note: [Checkpoint weights in the saved format]).
"""

from __future__ import annotations

import json
import os
from functools import partial
from typing import Any

import torch

from .streaming.store import DISK_ATTR, DiskSource, fix_mmap_threshold

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# What a snapshot download fetches: configs, safetensors weights, tokenizer files, custom code.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.py", "*.jinja"]
_OTHER_FORMATS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")


class ShardedWeights:
    """The safetensors files of a checkpoint directory and where each of the model's parameters comes from.

    Attributes:
        directory: the checkpoint directory.
        files: the weight files (one, or the shards the index names).
        file_of: checkpoint key -> file.
        keys_of: model parameter / buffer name -> the checkpoint keys it is converted from.
    """

    def __init__(self, directory: str, model: torch.nn.Module):
        self.directory = directory
        self.files = weight_files(directory)
        self.model = model
        self.file_of: dict[str, str] = {}
        self._entry: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}  # dtype, shape, start, end
        for path in self.files:
            for key, entry in _read_header(path).items():
                self.file_of[key] = path
                self._entry[key] = entry
        self.keys_of = self._targets(list(self.file_of))

    def __repr__(self) -> str:
        return f"ShardedWeights(directory={self.directory!r}, files={len(self.files)}, keys={len(self.file_of)})"

    def _targets(self, keys: list[str]) -> dict[str, list[str]]:
        """Model name -> checkpoint keys, as `weight_layout.group_by_target` groups them."""
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        from .weight_layout import weight_transforms

        transforms = weight_transforms(self.model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        expected = self.model.state_dict()
        out: dict[str, list[str]] = {}
        for key in keys:
            name, _ = rename_source_key(key, renamings, converters, self.model.base_model_prefix, expected)
            if name not in expected and key in expected:
                name = key
            if name in expected:
                out.setdefault(name, []).append(key)
        return out

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` for the model names ``names``, read and converted now.

        Tensors are read with plain file reads into new tensors (`_read_key`), not through a memory map: the file's
        pages stay in the page cache, outside the process's RSS, and nothing of the file stays mapped after the
        read."""
        from .weight_layout import converted, group_by_target

        missing = [n for n in names if n not in self.keys_of]
        if missing:
            raise ValueError(
                f"the checkpoint in {self.directory} has no weights for {missing[:5]} ({len(missing)} missing); it "
                "was written for another model configuration. Load a checkpoint of this model."
            )
        keys = [k for n in names for k in self.keys_of[n]]
        sources = {k: partial(self._read_key, k) for k in keys}
        groups, _ = group_by_target(self.model, sources)
        out: dict[str, torch.Tensor] = {}
        wanted = set(names)
        for target, group in groups.items():
            for name, t in converted(self.model, group, target).items():
                if name in wanted:
                    out[name] = t.contiguous()
        return out

    def _read_key(self, key: str) -> torch.Tensor:
        dtype, shape, start, end = self._entry[key]
        t = torch.empty(shape, dtype=dtype)
        if end > start:
            with open(self.file_of[key], "rb", buffering=0) as f:
                f.seek(start)
                view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                got = 0
                while got < end - start:
                    n = f.readinto(view[got:])
                    if not n:
                        raise ValueError(f"{self.file_of[key]} is truncated: tensor {key!r} ends past the file.")
                    got += n
        return t


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _read_header(path: str) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """``{key: (dtype, shape, start byte, end byte)}`` of a safetensors file (absolute offsets in the file)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path} is not a safetensors file (unreadable header: {e}).") from e
    out = {}
    for key, v in header.items():
        if key == "__metadata__":
            continue
        if v["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {key!r} has dtype {v['dtype']}, which lazytrain_hf cannot read.")
        a, b = v["data_offsets"]
        out[key] = (_SAFETENSORS_DTYPES[v["dtype"]], tuple(v["shape"]), 8 + n + a, 8 + n + b)
    return out


def find_weight_files(directory: str) -> list[str] | None:
    """The safetensors weight files of ``directory`` (one, or the shards its index names), or None."""
    single = os.path.join(directory, WEIGHTS_FILE)
    if os.path.isfile(single):
        return [single]
    index = os.path.join(directory, WEIGHTS_INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, s) for s in shards]
    return None


def weight_files(directory: str) -> list[str]:
    """The safetensors weight files of ``directory``, or ValueError saying what is there instead."""
    if not os.path.isdir(directory):
        raise ValueError(
            f"from_pretrained: {directory!r} is not a directory; pass a local directory written by save_pretrained "
            "or a Hub repository id (e.g. 'Qwen/Qwen3-0.6B')."
        )
    files = find_weight_files(directory)
    if files is not None:
        return files
    others = [n for n in _OTHER_FORMATS if os.path.exists(os.path.join(directory, n))]
    found = f" (found {', '.join(others)})" if others else ""
    raise ValueError(
        f"from_pretrained: {directory!r} has no safetensors weights ({WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}){found}. "
        "lazytrain_hf reads weights layer by layer from safetensors only: convert the checkpoint once with "
        "transformers (`AutoModelForCausalLM.from_pretrained(path).save_pretrained(new_path)`) and load new_path."
    )


def resolve_directory(
    name_or_path: str | os.PathLike,
    revision: str | None = None,
    cache_dir: str | None = None,
    token: str | bool | None = None,
    local_files_only: bool | None = None,
) -> str:
    """A local directory as is; a Hub repository id downloaded (safetensors, configs, tokenizer: `HUB_PATTERNS`)
    or found in the cache (offline, ``HF_HUB_OFFLINE=1`` or ``local_files_only``)."""
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        return path
    if os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1 or os.path.exists(path):
        raise ValueError(
            f"from_pretrained: {path!r} is not a directory; pass a local directory written by save_pretrained or a "
            "Hub repository id such as 'Qwen/Qwen3-0.6B'."
        )
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            path,
            revision=revision,
            cache_dir=cache_dir,
            token=token,
            allow_patterns=HUB_PATTERNS,
            local_files_only=bool(local_files_only),
        )
    except Exception as e:
        raise ValueError(
            f"from_pretrained: {path!r} is neither a local directory nor a Hub repository that could be fetched "
            f"({type(e).__name__}: {e}). Check the name and the network (offline, only repositories already in the "
            "Hub cache load), or pass a local directory."
        ) from e


def from_pretrained(
    name_or_path: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = "auto",
    attn_implementation: str | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
    token: str | bool | None = None,
    local_files_only: bool | None = None,
    trust_remote_code: bool = False,
    **config_kwargs: Any,
) -> torch.nn.Module:
    """The ``*ForCausalLM`` model of ``name_or_path`` with its decoder-layer weights left on disk.

    Decoder-layer parameters are meta tensors that the host store reads, one layer at a time, when the model is
    streamed (`LazyTrainer`, `lazytrain_hf.streaming.attach`); the embeddings, final norm, lm_head and buffers are
    loaded now. ``model.lazytrain_weights`` is the `ShardedWeights` record (files and keys). After streaming is
    removed, every parameter holds its (trained) values on the CPU.

    Args:
        name_or_path: a local directory (`save_pretrained` output) or a Hub repository id.
        dtype: parameter dtype; ``"auto"`` (default, as transformers): the config's ``dtype``, else float32.
        attn_implementation: e.g. ``"sdpa"`` or ``"eager"``.
        revision, cache_dir, token, local_files_only: as for `huggingface_hub.snapshot_download`.
        trust_remote_code: as for `transformers.AutoConfig`.
        config_kwargs: config attributes to override (e.g. ``use_cache=False``).

    Raises:
        ValueError: the directory does not exist, holds no safetensors weights, or its weights do not fit the
            config; a Hub id that cannot be fetched.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import models

    directory = resolve_directory(name_or_path, revision, cache_dir, token, local_files_only)
    weight_files(directory)  # a clear error before anything is built
    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code, **config_kwargs)
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"from_pretrained(dtype={dtype!r}) is not a torch dtype; use e.g. torch.bfloat16.")
        dtype = getattr(torch, dtype)
    kw: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        fix_mmap_threshold()  # Note: [A rank's large blocks are mapped] in streaming/store.py: before the model is built
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, **kw)
    # accelerate's init_empty_weights re-registers every parameter as a new meta tensor, which unties a tied lm_head
    # from the embedding: tie them again, as transformers' from_pretrained does after loading
    if getattr(config, "tie_word_embeddings", False) or getattr(
        config.get_text_config(), "tie_word_embeddings", False
    ):
        model.tie_weights()
    models.get_spec(model)  # ValueError naming the supported model types
    model.eval()  # as transformers' from_pretrained returns it
    weights = ShardedWeights(directory, model)
    source = DiskSource(weights.read, description=directory)
    layers = models.decoder_layers(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    now: list[str] = []
    for name, p in model.named_parameters():
        if id(p) in in_layers:
            setattr(p, DISK_ATTR, (source, name))
        else:
            now.append(name)
    params = dict(model.named_parameters())
    loaded = weights.read(now) if now else {}
    with torch.no_grad():
        for name in now:
            p = params[name]
            t = loaded.pop(name).to(p.dtype)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(
                    f"the checkpoint in {directory} has {name} of shape {tuple(t.shape)}, the model expects "
                    f"{tuple(p.shape)}; it was written for another model configuration."
                )
            torch.utils.swap_tensors(p, torch.nn.Parameter(t, requires_grad=p.requires_grad))
        buffers = {n: b for n, b in model.named_buffers() if n in weights.keys_of}
        for name, t in weights.read(list(buffers)).items() if buffers else ():
            buffers[name].copy_(t)
    model.lazytrain_weights = weights
    return model


def weights_on_disk(model: torch.nn.Module) -> int:
    """Number of parameters of ``model`` still on disk (meta tensors the host store will read)."""
    return sum(1 for p in model.parameters() if p.device.type == "meta" and getattr(p, DISK_ATTR, None) is not None)
