"""The records of the training state on NVMe and the host buffers its I/O goes through.

Owns what `lazytrain_hf.streaming.nvmestate` (the files, their commit and lifetime) and
`lazytrain_hf.streaming.stateupdate` (the chunked out-of-core optimizer step) share: `StateUnit` (one unit's file)
and `StateParam` (where one parameter's master, codes and scales lie in it, per generation), `StateNvmeError`,
`aligned_empty` (an `IO_ALIGN`-aligned host window for ``O_DIRECT``), and the helpers that point a tensor at a window
(`rebind`) or at nothing (`poison`, `poisoned_like`: the state is not in RAM). The byte sizes the planner predicts
are `lazytrain_hf.planner.layouts`'.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..activations.tiers import aligned, round_up
from ..planner import layouts
from ..planner.layouts import IO_ALIGN
from .store import poisoned


class StateNvmeError(OSError):
    """Reading or writing the training state in ``state_nvme_dir`` failed (e.g. ENOSPC). The committed state (the
    last complete optimizer step) is left as it was."""


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 host buffer of ``round_up(nbytes, IO_ALIGN)`` bytes at an `IO_ALIGN`-aligned address."""
    n = round_up(max(int(nbytes), 1), IO_ALIGN)
    return aligned(torch.empty(n + IO_ALIGN, dtype=torch.uint8), n, IO_ALIGN)


def poison(t: torch.Tensor) -> None:
    """Point ``t`` (same Python object: every holder sees it) at one NaN (zero for integer dtypes) with zero strides:
    the unit's state is not in RAM, and a read that should not happen sees garbage instead of stale values."""
    fill = float("nan") if t.dtype.is_floating_point else 0
    src = torch.full((1,), fill, dtype=t.dtype)
    t.set_(src.untyped_storage(), 0, t.shape, (0,) * t.dim())


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """`store.poisoned` of ``t``'s shape and dtype: replacing a view by it lets the view's base buffer go."""
    return poisoned(t.shape, t.dtype)


def rebind(t: torch.Tensor, window: torch.Tensor, byte_offset: int, shape: torch.Size) -> None:
    """Point ``t`` at ``shape`` contiguous elements of its dtype at ``byte_offset`` of the uint8 ``window``."""
    it = t.dtype.itemsize
    strides, acc = [], 1
    for d in reversed(tuple(shape)):  # contiguous strides
        strides.append(acc)
        acc *= int(d)
    strides = tuple(reversed(strides))
    base = window.storage_offset() + byte_offset
    if base % it:
        raise ValueError(f"byte offset {base} is not aligned to {t.dtype}")
    t.set_(window.untyped_storage(), base // it, shape, strides)


@dataclass
class StateParam:
    """Where one trainable parameter's state lives in its unit's file (laid out by `NvmeState.add_unit`)."""

    name: str
    numel: int
    elem_offset: int  # in the store's flat master / grad
    q8: bool
    nblk: int
    master: tuple[int, int]  # file offset per generation
    m_codes: tuple[int, int] = (0, 0)
    v_codes: tuple[int, int] = (0, 0)
    m_abs: tuple[int, int] = (0, 0)
    v_abs: tuple[int, int] = (0, 0)
    step: int = 0  # committed optimizer steps of this parameter
    small: tuple[torch.Tensor, torch.Tensor] | None = None  # fp32 m, v in RAM (tensors under min_8bit_size)
    chunk: int = layouts.CHUNK_ELEMS  # elements per chunk (Note: [The out-of-core optimizer step is chunked])
    abs_slot: int = 0  # bytes of each chunk's block-scale slot

    def chunks(self) -> list[tuple[int, int]]:
        return [(a, min(self.numel, a + self.chunk)) for a in range(0, self.numel, self.chunk)]

    def abs_at(self, a: int) -> int:
        """Byte offset of the block scales of the chunk starting at element ``a``, inside a scale region."""
        return (a // self.chunk) * self.abs_slot


@dataclass
class StateUnit:
    """One unit's state file: its descriptor, regions (compute copy at 0, gradient at ``grad_off``), parameters and
    committed generation."""

    key: int
    path: str
    fd: int
    compute_bytes: int
    grad_off: int
    train_elems: int
    params: list[StateParam]
    has_frozen: bool
    fused: bool  # the trainable compute copy is bf16 and written by the fused kernel (Note: [The compute copy is
    # written in the fused pass] in training/updater.py)
    aliased: bool
    compute_views: list[tuple[int, int, torch.dtype]] = field(default_factory=list)  # per param (byte off, n, dtype)
    gen: int = 0
    pending: dict[str, int] | None = None  # step counts written to generation 1 - gen, not committed yet
