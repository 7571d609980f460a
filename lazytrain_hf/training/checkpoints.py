"""What a LazyTrain run writes to disk and reads back, besides what `transformers.Trainer` itself saves.

Owns the checkpoint protocol on disk: staging directories renamed into place (Note: [Atomic checkpoints]), the fp32
masters file (Note: [fp32 masters in checkpoints]), the plan next to the weights (`write_plan` / `read_plan`), the
check of every file a resume reads (`verify_checkpoint`), which checkpoint a resume means (`resolve_checkpoint`) and
the model card section, and the weights a resume loads in the format `save_pretrained` wrote them
(`load_checkpoint_weights`, Note: [Checkpoint weights in the saved format]). Functions take directories, plans, the
model and the executor's objects (`StreamHandle`, `LayerwiseUpdater`) as arguments: this module never imports
`transformers.Trainer`, never writes optimizer or scheduler files (Trainer's `_save_checkpoint` does, into the
staging directory) and moves nothing to the device. The weights of a streamed model are written here, layer by layer
from the host store (`save_streamed`, Note: [Checkpoints are streamed from the host store]).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil

import torch
from transformers.utils import logging

from ..args import PLAN_FILE
from ..loading import WEIGHTS_FILE, WEIGHTS_INDEX_FILE
from ..loading import find_weight_files as _weight_files
from ..units import format_bytes
from .lazytensor import LazyTensor

MASTER_FILE = "lazytrain_master.safetensors"

logger = logging.get_logger(__name__)

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
    if path is None or not os.path.exists(path):
        return
    from safetensors.torch import load_file

    saved = load_file(path)
    targets = separate_masters(handle, updater, store=where == "store", resident=where == "resident")
    spill = getattr(handle, "nvme_state", None) if handle is not None else None
    units = {e.name: k for k, ls in handle.store.layers.items() for e in ls.entries} if spill is not None else {}
    with torch.no_grad():
        for name, dst in targets.items():
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


# ---------------------------------------------------------------------- optimizer state of units on NVMe
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
        for name, step in steps.items():
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
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor, in a declared order, without holding the file in memory.

    Args:
        path: the file to write.
        specs: ``[(name, dtype, shape)]`` in the order the tensors will be written (their data offsets follow it).
        metadata: the header's ``__metadata__`` (string values).
    """

    def __init__(
        self, path: str, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None = None
    ) -> None:
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        self._order: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        for name, dtype, shape in specs:
            if dtype not in SAFETENSORS_DTYPES:
                raise TypeError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store.")
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._order.append((name, dtype, tuple(shape), nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors pads it
        self.path = path
        self._f = open(path, "wb")
        self._f.write(len(raw).to_bytes(8, "little"))
        self._f.write(raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor (it must be the next one declared, with its dtype and shape)."""
        if self._next >= len(self._order):
            raise ValueError(f"{self.path}: tensor {name!r} written after every declared tensor.")
        want, dtype, shape, nbytes = self._order[self._next]
        if name != want or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{self.path}: expected tensor {want!r} ({dtype}, {shape}) next, got {name!r} "
                f"({tensor.dtype}, {tuple(tensor.shape)})."
            )
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.contiguous()  # a view of the host store is contiguous already: no copy
        if nbytes:
            self._f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        missing = [n for n, *_ in self._order[self._next :]]
        self._f.close()
        if missing:
            raise ValueError(f"{self.path}: {len(missing)} declared tensor(s) never written: {missing[:5]}.")


def write_safetensors(path: str, tensors: list[tuple[str, torch.Tensor]], metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file`` without building the file in memory: each tensor written from its storage
    (a `LazyTensor` read right before it is written)."""
    w = SafetensorsWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors], metadata or {"format": "pt"})
    try:
        for n, t in tensors:
            w.write(n, t.read() if isinstance(t, LazyTensor) else t)
    finally:
        w._f.close()
    w.close()


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
    return _is_pretrained(model)


def _weight_groups(model) -> list[list[str]]:
    """The model's saved state-dict names grouped for conversion and writing: one group per decoder layer (every
    key under ``<layers>.<i>.``), every other key alone; in state-dict order."""
    import re

    from .. import models

    saved = _saved_names(model)
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


def verify_checkpoint(checkpoint_dir: str, model=None) -> None:
    """Open every file a resume reads (weights, optimizer, scheduler and RNG states, trainer state, plan) without
    loading it into the model; a corrupted or truncated one raises ValueError naming the file. (`training_args.bin`
    is written by Trainer for reference only and never read back.) With ``model``, the weights must also cover every
    parameter and buffer it saves, once converted as a resume converts them (`check_weights_cover`)."""
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
    if model is not None:
        check_weights_cover(checkpoint_dir, model)


def read_plan(checkpoint_dir: str):
    """The plan saved with a checkpoint (or None). Corrupted files raise an error naming the file."""
    from ..planner.plan import Plan

    path = os.path.join(checkpoint_dir, PLAN_FILE)
    if not os.path.exists(path):
        return None
    return Plan.from_json(path)


# ---------------------------------------------------------------------- weights in the saved format
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
    if files is not None and _is_pretrained(model) and _on_disk(model):
        _point_at_checkpoint(checkpoint_dir, model)
        return True
    if files is None or not _is_pretrained(model) or not _weight_transforms(model):
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
    if files is None or not _is_pretrained(model):
        return
    problem = _coverage_problem(checkpoint_dir, files, model)
    if problem is not None:
        raise ValueError(problem)


def _is_pretrained(model) -> bool:
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _weight_transforms(model) -> list:
    """The weight transforms `from_pretrained` applies to ``model``'s checkpoints: the ones it recorded when it loaded
    the model, else transformers' conversion mapping for the model's class (as `revert_weight_conversion` picks the
    ones it reverts on save), legacy renamings excluded (never applied on save)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(model, add_legacy=False)


def _group_by_target(model, sources: dict) -> tuple[dict, list[str]]:
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

    transforms = _weight_transforms(model)
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


def _converted(model, group, target: str) -> dict[str, torch.Tensor]:
    out = group.convert(target, model=model, config=model.config)
    return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


def _saved_names(model) -> set[str]:
    """The names of the parameters and buffers ``model`` saves (tied copies and `_keys_to_ignore_on_save` left
    out, as `save_pretrained` leaves them out)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    # on meta tensors (tied weights found by parameter identity): with real tensors it clones every parameter that
    # shares a storage without being tied, i.e. every view of the host store (Note: [Checkpoints are streamed from
    # the host store])
    meta = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in model.state_dict().items()}
    names = set(remove_tied_weights_from_state_dict(meta, model))
    return names - set(model._keys_to_ignore_on_save or ())


def _coverage_problem(checkpoint_dir: str, files: list[str], model) -> str | None:
    """What `check_weights_cover` reports, or None: the checkpoint's keys converted on meta tensors of their shapes."""
    from safetensors import safe_open
    from transformers.core_model_loading import dot_natural_key, revert_weight_conversion

    sources = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                sources[key] = torch.empty(f.get_slice(key).get_shape(), device="meta")
    groups, _ = _group_by_target(model, sources)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    covered, unfit = set(), {}
    for target, group in groups.items():
        try:
            out = _converted(model, group, target)
        except Exception as e:  # e.g. gate and up projections of different expert counts
            unfit[target] = f"conversion failed: {type(e).__name__}: {e}"
            continue
        for name, t in out.items():
            if name in shapes and tuple(t.shape) != shapes[name]:
                unfit[name] = f"shape {tuple(t.shape)} from the checkpoint, {shapes[name]} in the model"
            else:
                covered.add(name)
    saved = _saved_names(model)
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
        groups, unexpected = _group_by_target(model, sources)
        if unexpected:
            logger.warning(f"There were unexpected keys in the checkpoint model loaded: {unexpected}.")
        targets = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for target, group in groups.items():
                for name, t in _converted(model, group, target).items():
                    if name in targets:
                        targets[name].copy_(t)


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
