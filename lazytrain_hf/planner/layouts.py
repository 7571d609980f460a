"""The executor's byte layouts as pure functions of shapes and dtypes: what a plan's memory and transfers are sized
with.

The planner (`hostmem.py`, `schedule.py`, `costmodel.py`) predicts bytes with these functions and the streaming
executor lays its buffers and files out with the same ones, so a prediction is the executor's byte count by
construction, and the planner needs nothing of the executor itself. This module owns:

- the host store's layout (implemented by `lazytrain_hf.streaming.store`): `ALIGN_BYTES`, `align_up`,
  `LayerLayout`, `layer_layout`;
- which of a layer's parameters the host store streams (implemented by `lazytrain_hf.streaming.binder`):
  `RESIDENT_TRAINABLE_FRACTION`, `streamed_parameters`, and `hf_root` (the model under a PEFT wrapper);
- the training state on NVMe (implemented by `lazytrain_hf.streaming.nvmestate`): `IO_ALIGN` (the ``O_DIRECT``
  block, also the activation spill files', `lazytrain_hf.activations.nvme`), `CHUNK_ELEMS` (Note: [The
  out-of-core optimizer step is chunked]), `state_file_bytes` (a unit's file) and `update_bytes` (what one unit's
  out-of-core optimizer step reads and writes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

# ------------------------------------------------------------------------------------------------ host store

# Every parameter starts at a multiple of 256 bytes inside the flat buffers and the device slots: enough for any
# dtype view (`Tensor.view(dtype)` needs itemsize alignment), for vectorised CPU kernels (64 B) and for CUDA
# (cudaMalloc gives 256 B alignment; some kernels assume 16 B).
ALIGN_BYTES = 256


def align_up(n: int, to: int = ALIGN_BYTES) -> int:
    """``n`` rounded up to a multiple of ``to`` (default `ALIGN_BYTES`)."""
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class LayerLayout:
    """Byte layout of one layer in the host store (what `HostStore.add_layer` allocates), from shapes and dtypes.

    Attributes:
        offsets: per parameter, in store order (trainable first): ``(byte offset in the compute copy, element offset
            in the fp32 master / grad buffers or -1 for a frozen parameter, compute dtype)``.
        order: the input indices of the parameters in store order.
        compute_bytes: bytes of the compute copy (alignment padding included; also a device slot's size).
        train_elems: elements of the fp32 master and of the gradient accumulator (0: no trainable parameter).
        aliased: the compute copy is fp32 and the master is a prefix of it (Note: [Compute copy aliases the fp32
            master]).
    """

    offsets: tuple[tuple[int, int, torch.dtype], ...]
    order: tuple[int, ...]
    compute_bytes: int
    train_elems: int
    aliased: bool

    @property
    def master_bytes(self) -> int:
        """Bytes of the separate (pageable) fp32 master: 0 when aliased with the compute copy."""
        return 0 if self.aliased else 4 * self.train_elems

    @property
    def grad_bytes(self) -> int:
        return 4 * self.train_elems


def layer_layout(params: list[tuple[int, torch.dtype, bool]], compute_dtype: torch.dtype | None = None) -> LayerLayout:
    """The store layout of a layer whose streamed parameters are ``params`` = ``[(numel, dtype, trainable)]``.

    Trainable parameters come first; with one compute dtype every parameter starts at an element offset aligned to
    `ALIGN_BYTES` shared by the compute copy, the master and the grad; with several, the compute copy is a byte
    buffer with its own aligned offsets. ``compute_dtype``: the compute copy of fp32 parameters in this dtype.
    """
    order = [i for i, (_, _, t) in enumerate(params) if t] + [i for i, (_, _, t) in enumerate(params) if not t]

    def dtype_of(dt: torch.dtype) -> torch.dtype:
        return compute_dtype if compute_dtype is not None and dt == torch.float32 else dt

    dtypes = {dtype_of(params[i][1]) for i in order}
    single = next(iter(dtypes)) if len(dtypes) == 1 else None
    offsets = []
    elem = 0  # next free element in the fp32 master / grad buffers (and, for one dtype, the compute copy)
    byte = 0  # next free byte in the compute copy (mixed dtypes only)
    n_train = 0
    for i in order:
        numel, dt, trainable = params[i]
        cdt = dtype_of(dt)
        if single is not None:
            elem = align_up(elem, max(1, ALIGN_BYTES // single.itemsize))
            b_off, e_off = elem * single.itemsize, elem
            elem += numel
        else:
            b_off = byte = align_up(byte)
            byte += numel * cdt.itemsize
            e_off = -1
            if trainable:
                e_off = elem = align_up(elem, ALIGN_BYTES // 4)
                elem += numel
        if trainable:
            n_train = max(n_train, e_off + numel)
        offsets.append((b_off, e_off if trainable else -1, cdt))
    if single is not None:
        byte = elem * single.itemsize
    return LayerLayout(tuple(offsets), tuple(order), align_up(byte), n_train, single == torch.float32)


# ------------------------------------------------------------------------------------------------ streamed parameters

# A layer that mixes frozen and trainable parameters keeps its trainable ones resident (ordinary `.grad`) when they
# hold less than this share of its elements: adapters such as LoRA (r=16 on a 4096-wide q_proj is ~0.8%). Larger
# trainable parts (e.g. a fully trained MLP beside a frozen attention) are streamed with host gradients.
RESIDENT_TRAINABLE_FRACTION = 0.1


def streamed_parameters(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Which of a decoder layer's parameters the host store streams: all of them, or only the frozen ones when the
    trainable ones are under `RESIDENT_TRAINABLE_FRACTION` of the layer (adapters stay resident). The executor, the
    host-memory accounting and the planner's byte counts all read the split from here."""
    trainable = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    n_train = sum(p.numel() for p in trainable)
    n_all = sum(p.numel() for p in params)
    keep_train_resident = bool(frozen) and bool(trainable) and n_train < RESIDENT_TRAINABLE_FRACTION * n_all
    return frozen if keep_train_resident else params


def hf_root(model: nn.Module) -> nn.Module:
    """The `*ForCausalLM` model under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


# ------------------------------------------------------------------------------------------------ state on NVMe

# Block size of O_DIRECT transfers: buffer addresses, file offsets and lengths are multiples of it. 4096 covers
# drives with 512-byte and 4 KiB logical blocks (Linux requires the logical block size; 4096 is a multiple of both).
IO_ALIGN = 4096
# Elements per optimizer chunk: a multiple of 4096 (byte offsets of 1-byte codes stay aligned) and of every block
# size up to 4096; each chunk's block scales have a slot of their own, `IO_ALIGN`-aligned. Read when a unit is laid
# out (`NvmeState.add_unit`), which fixes it for that unit, and when a plan's host windows and files are sized.
CHUNK_ELEMS = 1 << 22


def state_file_bytes(
    tensors: list[tuple[int, torch.dtype, bool]],
    compute_bytes: int,
    train_elems: int,
    block_size: int = 256,
    min_8bit_size: int = 4096,
) -> int:
    """Bytes of one unit's state file (`NvmeState.add_unit`'s layout) for its trainable tensors' sizes."""
    off = align_up(compute_bytes, IO_ALIGN) + align_up(4 * train_elems, IO_ALIGN)
    for n, _, t in tensors:
        if not t:
            continue
        off += 2 * align_up(4 * n, IO_ALIGN)
        if n >= min_8bit_size:
            slots = math.ceil(n / CHUNK_ELEMS) * align_up(4 * (CHUNK_ELEMS // block_size), IO_ALIGN)
            off += 2 * (2 * align_up(n, IO_ALIGN) + 2 * slots)
    return off


def update_bytes(
    tensors: list[tuple[int, Any, bool]],
    compute_bytes: int,
    block_size: int = 256,
    min_8bit_size: int = 4096,
) -> tuple[int, int]:
    """``(bytes read, bytes written)`` of one `NvmeState.update_unit` of a unit whose streamed tensors are
    ``[(numel, dtype, trainable)]``: per trainable tensor its master and gradient (and 8-bit codes and scales) in, its
    master (and moments) out; the compute copy out, and in first when the unit has frozen tensors."""
    read = write = 0
    for n, _, t in tensors:
        if not t:
            continue
        q = 2 * n + 8 * math.ceil(n / block_size) if n >= min_8bit_size else 0
        read += 8 * n + q
        write += 4 * n + q
    write += compute_bytes
    if any(not t for _, _, t in tensors):
        read += compute_bytes
    return read, write
