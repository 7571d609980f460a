"""Saved-tensor layouts: how an activation is copied out compactly and restored with the same strides.

Owns `Layout`, `ParamRef` (a saved weight stored as the executor's reference) and the small identity helpers of
saved tensors (storage keys, fingerprints, the tensors inside a layer call's arguments). Pure functions of tensors:
no tiers, no streams, no plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

# Note: [Saved tensors are restored with their layout]
# A saved tensor comes back with the same dtype, shape and strides, and with the same storage offset modulo 64 bytes
# (the alignment phase that vectorised kernels and BLAS blocking may depend on), so the backward kernels run exactly
# the code paths they run under plain autograd and gradients are bit-identical. Only the elements the view covers
# are copied ("compact" copy, in the view's own dimension order); broadcast (stride-0) dimensions are copied once
# and re-expanded. Gapped views (e.g. the halves of a chunked gate_up projection) are restored into a fresh storage
# with the same strides, i.e. the same span the original base storage had: never more device memory than the
# original. Views whose elements overlap in memory cannot be restored by a copy and stay on the device.
ALIGN_BYTES = 64


@dataclass(frozen=True)
class Layout:
    """How to copy a strided tensor out compactly and restore it with the same strides (see the Note above)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    narrow: tuple[int, ...]  # size with broadcast (stride-0) dimensions reduced to 1: what is actually copied
    compact: tuple[int, ...]  # dense strides in the view's own dimension order: the host / file layout
    numel: int  # elements copied (prod(narrow))
    span: int  # elements the restored storage needs after `pad`
    pad: int  # storage offset of the restored view, in elements: keeps the 64-byte alignment phase
    dense: bool  # restored memory image == compact image (no gaps), so bytes can land in place

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @staticmethod
    def of(t: torch.Tensor) -> Layout | None:
        """The layout of ``t``, or ``None`` when its elements overlap in memory (cannot be restored by a copy)."""
        size, stride = tuple(t.shape), tuple(t.stride())
        narrow = tuple(1 if st == 0 else s for s, st in zip(size, stride))
        compact = [1] * len(size)
        extent, acc = 0, 1
        for d in sorted((d for d in range(len(size)) if narrow[d] > 1), key=lambda d: stride[d]):
            if stride[d] <= extent:
                return None
            compact[d] = acc
            acc *= narrow[d]
            extent += (narrow[d] - 1) * stride[d]
        numel = math.prod(narrow)
        itemsize = t.element_size()
        align = ALIGN_BYTES // itemsize if ALIGN_BYTES % itemsize == 0 else 1
        return Layout(
            size=size,
            stride=stride,
            dtype=t.dtype,
            narrow=narrow,
            compact=tuple(compact),
            numel=numel,
            span=extent + 1,
            pad=t.storage_offset() % align,
            dense=extent + 1 == numel,
        )

    def source(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with its broadcast dimensions narrowed to one element (the elements to copy)."""
        return t if self.narrow == self.size else t.as_strided(self.narrow, self.stride)

    def host_view(self, buf: torch.Tensor) -> torch.Tensor:
        """The compact view of a byte buffer that holds this tensor's elements."""
        return buf[: self.nbytes].view(self.dtype).as_strided(self.narrow, self.compact)

    def empty(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fresh storage on ``device``: ``(storage, narrowed view to copy into, final view to return)``."""
        storage = torch.empty(self.pad + self.span, dtype=self.dtype, device=device)
        return (
            storage,
            storage.as_strided(self.narrow, self.stride, self.pad),
            storage.as_strided(self.size, self.stride, self.pad),
        )

    def landing_bytes(self, storage: torch.Tensor) -> torch.Tensor:
        """For a dense layout: the bytes of ``storage`` the compact image lands in unchanged."""
        start = self.pad * self.itemsize
        return storage.view(torch.uint8)[start : start + self.nbytes]


def plain_strided(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and type(t) in (torch.Tensor, nn.Parameter) and not t.is_meta


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def fingerprint(t: torch.Tensor) -> tuple | None:
    """Identity of a tensor's data: storage, offset, shape, strides, dtype and version (views share the version
    counter, so an in-place change after the fingerprint was taken is seen). None for tensors without a storage."""
    if not plain_strided(t):
        return None
    return (storage_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)


def tensors_in(obj: Any, out: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    """Tensors inside (nested) tuples, lists and dicts: the shared inputs of a layer call."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 4 and isinstance(obj, list | tuple):
        for o in obj:
            tensors_in(o, out, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for o in obj.values():
            tensors_in(o, out, depth + 1)
    return out


class ParamRef:
    """A weight packed by the executor's `ParamPacker`: only the reference is stored."""

    __slots__ = ("ref",)

    def __init__(self, ref: object) -> None:
        self.ref = ref
