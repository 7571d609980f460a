"""Block-wise dynamic 8-bit quantisation of optimizer moments (the state type of `HybridAdamW8bit`).

A tensor of ``n`` fp32 values is cut into blocks of ``block_size`` elements (the last block may be shorter). Each
block keeps one fp32 *absmax* (its largest magnitude) and one uint8 *code* per element; an element is stored as the
index of the entry of a 256-value *code map* nearest to ``value / absmax``. The code maps are the dynamic maps of
Dettmers et al., "8-Bit Approximations for Parallelism in Deep Learning" (arXiv:1511.04561), as built by
``bitsandbytes.functional.create_dynamic_map``: a signed map for the first moment (which changes sign) and an
unsigned map for the second moment (never negative, so all 256 codes cover ``[0, 1]``).

Rounding is to the nearest code, ties to the lower code, exactly as ``torch.bucketize`` over the midpoints of the
sorted map, with one exception for the unsigned map (see Note: [A non-zero second moment keeps a non-zero code]).
The fused kernels do not binary-search the map: they use `CodeLookup`, a table indexed by the top 17 bits of the
float32 value that gives, for every bucket of floats, the code of the bucket's lowest value; one comparison with the
next midpoint finishes the rounding. This is exact because no bucket of the table contains more than one midpoint,
which `CodeLookup` checks when it is built.

Note: [A non-zero second moment keeps a non-zero code]
    ``v`` holds squared gradients, so an element far below its block's maximum (|g| under ~4e-4 of the block's
    largest, v under ``code_map[1] / 2`` = 1.6e-7 of its absmax) would round to the code of 0.0 while its ``m``
    survives, and the next step would be ``lr * m_hat / eps`` instead of ``lr * m_hat / sqrt(v_hat)``: 675x lr on
    issue #14's reproduction, 224-800x lr on embedding rows of tokens absent from a batch (tests/test_optim_sparse.py,
    before this rule). So the unsigned map rounds every positive value
    to a non-zero code: its first midpoint is 0.0 instead of ``code_map[1] / 2``, and values in
    ``(0, code_map[1] / 2]`` take ``code_map[1]`` (3.25e-7 x absmax); 0.0 keeps code 0. It is a change of one
    midpoint, so the lookup tables of every backend carry it and no kernel does extra work. bitsandbytes' CPU
    quantizer also never stores 0 for v (its search stops at code 7, 1.56e-5 x absmax, even for 0.0).
    Chosen over storing ``sqrt(v)`` (which halves the exponent range) by measurement (``benchmarks/bench_optim.py
    --step-bound``, BENCHMARKS.md's optimizer section): with the rule the largest step over sparse gradient
    families stays at 1.84 lr (torch AdamW: 1.00-1.46 lr on the same gradients), against 3.8-4.1 lr for sqrt(v)
    with the rule and 46-1.2e6 lr for sqrt(v) alone. sqrt(v) keeps small elements finer (on the end-to-end
    embedding test the largest excess of a row's step over AdamW's is 0.16 lr against 0.31 lr), but its rounding
    error falls on sqrt(v) itself rather than on v under a square root, so its worst case is looser; it would also
    add a multiply per element and change the state format. Dense accuracy is unchanged (the least-squares
    trajectory of tests/test_optim.py deviates at most 4.81% from AdamW's with either rule). The price of the rule:
    an element whose v is under 1.6e-7 of its block's absmax steps less than with AdamW, as v rounds up.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

# Smallest absmax the quantizer divides by: an all-zero block (absmax 0) quantizes to the code of 0.0 instead of
# NaN. The same clamp as bitsandbytes' reference `quantize_blockwise`, so the codes agree with it.
ABSMAX_FLOOR = 1e-38

# The lookup table is indexed by the float32 bits shifted right by this much: sign, 8 exponent bits and the top
# 8 mantissa bits, i.e. buckets at most 2**-8 wide relative to the values in them. The finest spacing of the
# dynamic maps (0.9 / 128 in the top decade of the unsigned map) is wider, so a bucket holds at most one midpoint.
LOOKUP_SHIFT = 15


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The dynamic quantisation map, value for value the one ``bitsandbytes.functional.create_dynamic_map`` builds.

    Each decade ``10**-(max_exponent_bits - 1 - i)`` gets a linear grid of fractions whose size doubles with ``i``,
    so small magnitudes keep relative precision. Written out here so the optimizer does not import bitsandbytes;
    a test checks equality with bitsandbytes.

    Args:
        signed (`bool`, *optional*, defaults to `True`):
            Signed map (codes in ``[-1, 1]``, for the first moment) or unsigned (``[0, 1]``, second moment).
        max_exponent_bits (`int`, *optional*, defaults to 7):
            Number of decades covered.
        total_bits (`int`, *optional*, defaults to 8):
            Code width; the map has ``2**total_bits`` sorted entries.

    Returns:
        `torch.Tensor`: float32 tensor of ``2**total_bits`` sorted values, containing 0.0 and 1.0.
    """
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        exponent = i + non_sign_bits - max_exponent_bits
        fraction_items = int(2**exponent + 1 if signed else 2 ** (exponent + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    if len(data) > 2**total_bits:
        raise ValueError(
            f"create_dynamic_map(max_exponent_bits={max_exponent_bits}, total_bits={total_bits}) builds {len(data)} "
            f"values, more than 2**total_bits; lower max_exponent_bits."
        )
    data += [0.0] * (2**total_bits - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


@dataclass(frozen=True)
class CodeLookup:
    """Everything the quantize/dequantize kernels need for one sorted 256-entry code map.

    Attributes:
        code_map (`np.ndarray`): float32[256], the sorted map (dequantize: ``code_map[code] * absmax``).
        bounds (`np.ndarray`): float32[256], midpoints between neighbouring entries (as bitsandbytes computes
            them), padded with ``+inf`` so that ``bounds[255]`` exists.
        lut (`np.ndarray`): uint8[2**17]; ``lut[bits >> 15]`` is the code of the lowest float of that bucket.
        bucket_mid (`np.ndarray`): float32[2**17], ``bounds[lut[k]]``: the one midpoint that can lie in bucket ``k``.
            The nearest code of ``x`` is ``lut[k] + (x > bucket_mid[k])`` with ``k = bits(x) >> 15``; both tables
            are indexed by ``k`` so the two loads do not depend on each other.
        zero_code (`int`): code of 0.0, the initial value of every element.
        code_map_t (`torch.Tensor`), mids_t (`torch.Tensor`): the map and its 255 midpoints as tensors (torch path).
        keep_nonzero (`bool`): whether positive values below the first midpoint take code 1 instead of 0 (the
            first midpoint is then 0.0; Note: [A non-zero second moment keeps a non-zero code]).
    """

    code_map: np.ndarray
    bounds: np.ndarray
    lut: np.ndarray
    bucket_mid: np.ndarray
    zero_code: int
    code_map_t: torch.Tensor
    mids_t: torch.Tensor
    keep_nonzero: bool = False

    @classmethod
    def from_map(cls, code_map: torch.Tensor, keep_nonzero: bool = False) -> CodeLookup:
        """Build and verify the lookup for a sorted float32 map of 256 values in ``[-1, 1]``.

        Args:
            code_map (`torch.Tensor`): the sorted map.
            keep_nonzero (`bool`, *optional*, defaults to `False`):
                Round every positive value to a non-zero code (for an unsigned map, whose first two entries are
                0.0 and the smallest positive value): the first midpoint becomes 0.0. Without it, rounding is to
                the nearest code, as bitsandbytes' ``quantize_blockwise`` defines it.
        """
        cmap = np.ascontiguousarray(code_map.detach().cpu().to(torch.float32).numpy())
        if cmap.shape != (256,) or np.any(np.diff(cmap) < 0) or np.abs(cmap).max() > 1.0:
            raise ValueError(
                f"code_map must be 256 sorted float32 values in [-1, 1]; got shape {tuple(cmap.shape)}. "
                f"Build one with create_dynamic_map(signed=...)."
            )
        if keep_nonzero and not (cmap[0] == 0.0 and cmap[1] > 0.0):
            raise ValueError(
                f"keep_nonzero needs an unsigned map starting 0.0, then a positive value; got {cmap[:2].tolist()}. "
                f"Use it with create_dynamic_map(signed=False)."
            )
        # Midpoints computed in float32 exactly as bitsandbytes does: (code[:-1] + code[1:]) / 2.
        mids = ((torch.from_numpy(cmap[:-1]) + torch.from_numpy(cmap[1:])) / 2).numpy()
        if keep_nonzero:
            # Note: [A non-zero second moment keeps a non-zero code]: count(mids < x) is then >= 1 for any x > 0.
            mids[0] = np.float32(0.0)
        bounds = np.append(mids, np.float32(np.inf)).astype(np.float32)
        keys = np.arange(2 ** (32 - LOOKUP_SHIFT), dtype=np.uint64)
        low_bits = keys << LOOKUP_SHIFT
        high_bits = low_bits | ((1 << LOOKUP_SHIFT) - 1)
        negative = keys >= 2 ** (31 - LOOKUP_SHIFT)
        # For negative floats a larger bit pattern is a more negative value, so the two ends swap.
        lowest = np.where(negative, high_bits, low_bits).astype(np.uint32).view(np.float32)
        highest = np.where(negative, low_bits, high_bits).astype(np.uint32).view(np.float32)
        finite = np.isfinite(lowest) & np.isfinite(highest)
        # count(mids < x) is torch.bucketize(x, mids, right=False): the nearest code, ties to the lower one.
        lo = np.searchsorted(mids, lowest, side="left")
        hi = np.searchsorted(mids, highest, side="left")
        if np.any((hi - lo)[finite] > 1):
            raise ValueError(
                "code_map has neighbouring midpoints closer than the lookup resolution (2**-8 relative); "
                "use a map with at most 256 codes spread like create_dynamic_map."
            )
        lut = np.where(finite, lo, 0).astype(np.uint8)
        zero_code = int(np.searchsorted(mids, np.float32(0.0), side="left"))
        return cls(
            code_map=cmap,
            bounds=bounds,
            lut=lut,
            bucket_mid=np.ascontiguousarray(bounds[lut.astype(np.int64)]),
            zero_code=zero_code,
            code_map_t=torch.from_numpy(cmap.copy()),
            mids_t=torch.from_numpy(mids.copy()),
            keep_nonzero=bool(keep_nonzero),
        )


@functools.cache
def dynamic_lookup(signed: bool) -> CodeLookup:
    """The (cached) lookup of the signed (first moment) or unsigned (second moment) dynamic map.

    The unsigned one keeps every positive value non-zero (Note: [A non-zero second moment keeps a non-zero code]).
    """
    return CodeLookup.from_map(create_dynamic_map(signed=signed), keep_nonzero=not signed)


def num_blocks(n: int, block_size: int) -> int:
    """Number of quantisation blocks of ``n`` elements (the last one may be partial)."""
    return math.ceil(n / block_size)


class Quantized8bit:
    """A flat fp32 tensor stored as block-wise dynamic 8-bit codes.

    Args:
        codes (`torch.Tensor`): uint8 tensor of ``n`` codes (1-D, contiguous, CPU).
        absmax (`torch.Tensor`): float32 tensor of ``ceil(n / block_size)`` per-block scales.
        block_size (`int`): elements per block.
        signed (`bool`): whether ``codes`` index the signed or the unsigned dynamic map.
        lookup (`CodeLookup`, *optional*): the map and rounding rule; defaults to `dynamic_lookup(signed)`.

    The element ``i`` represents ``code_map[codes[i]] * absmax[i // block_size]``.
    """

    __slots__ = ("codes", "absmax", "block_size", "signed", "lookup")

    def __init__(
        self,
        codes: torch.Tensor,
        absmax: torch.Tensor,
        block_size: int,
        signed: bool,
        lookup: CodeLookup | None = None,
    ) -> None:
        if codes.dtype != torch.uint8 or codes.dim() != 1:
            raise TypeError(f"codes must be a 1-D uint8 tensor; got dtype={codes.dtype}, shape={tuple(codes.shape)}.")
        if absmax.dtype != torch.float32 or absmax.dim() != 1:
            raise TypeError(
                f"absmax must be a 1-D float32 tensor; got dtype={absmax.dtype}, shape={tuple(absmax.shape)}."
            )
        if absmax.numel() != num_blocks(codes.numel(), block_size):
            raise ValueError(
                f"absmax has {absmax.numel()} entries but {codes.numel()} codes in blocks of {block_size} need "
                f"{num_blocks(codes.numel(), block_size)}."
            )
        self.codes = codes
        self.absmax = absmax
        self.block_size = int(block_size)
        self.signed = bool(signed)
        self.lookup = dynamic_lookup(self.signed) if lookup is None else lookup

    @classmethod
    def zeros(cls, n: int, block_size: int, signed: bool) -> Quantized8bit:
        """``n`` zeros: every code is the code of 0.0 and every absmax is 0."""
        codes = torch.full((n,), dynamic_lookup(signed).zero_code, dtype=torch.uint8)
        absmax = torch.zeros(num_blocks(n, block_size), dtype=torch.float32)
        return cls(codes, absmax, block_size, signed)

    @classmethod
    def from_tensor(cls, x: torch.Tensor, block_size: int, signed: bool) -> Quantized8bit:
        """Quantize a float tensor (flattened), as `quantize_`."""
        q = cls.zeros(x.numel(), block_size, signed)
        q.quantize_(x)
        return q

    @property
    def numel(self) -> int:
        return self.codes.numel()

    @property
    def code_map(self) -> torch.Tensor:
        return self.lookup.code_map_t.clone()

    def nbytes(self) -> int:
        """Bytes held: one per code plus four per block scale."""
        return self.codes.numel() * self.codes.element_size() + self.absmax.numel() * self.absmax.element_size()

    def _blocks(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        full = (x.numel() // self.block_size) * self.block_size
        head = x[:full].view(-1, self.block_size)
        tail = x[full:].view(1, -1) if full < x.numel() else None
        return head, tail

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The represented float32 values as a flat tensor (written into ``out`` when given)."""
        values = self.lookup.code_map_t[self.codes.long()]
        head, tail = self._blocks(values)
        nb_head = head.shape[0]
        head.mul_(self.absmax[:nb_head].unsqueeze(1))
        if tail is not None:
            tail.mul_(self.absmax[nb_head:])
        if out is not None:
            out.view(-1).copy_(values)
            return out
        return values

    def quantize_(self, x: torch.Tensor) -> Quantized8bit:
        """Store ``x`` (any float tensor with ``numel`` elements, flattened): new absmax per block, nearest codes
        (positive values of an unsigned map never take code 0: Note: [A non-zero second moment keeps a non-zero
        code])."""
        if x.numel() != self.numel:
            raise ValueError(f"quantize_ got {x.numel()} values for a Quantized8bit of {self.numel}.")
        x = x.detach().reshape(-1).to(torch.float32)
        head, tail = self._blocks(x)
        parts = [head] if tail is None else [head, tail]
        mids = self.lookup.mids_t
        codes, scales = [], []
        for part in parts:
            absmax = part.abs().amax(dim=1)
            scaled = torch.clamp(part * (1.0 / absmax.clamp(min=ABSMAX_FLOOR)).unsqueeze(1), -1, 1)
            codes.append(torch.bucketize(scaled.reshape(-1), mids, out_int32=True).to(torch.uint8))
            scales.append(absmax)
        self.codes.copy_(torch.cat(codes) if len(codes) > 1 else codes[0])
        self.absmax.copy_(torch.cat(scales) if len(scales) > 1 else scales[0])
        return self

    def clone(self) -> Quantized8bit:
        return Quantized8bit(self.codes.clone(), self.absmax.clone(), self.block_size, self.signed, self.lookup)

    def __repr__(self) -> str:
        kind = "signed" if self.signed else "unsigned"
        return (
            f"Quantized8bit(numel={self.numel}, block_size={self.block_size}, map={kind} dynamic, "
            f"blocks={self.absmax.numel()}, bytes={self.nbytes()})"
        )
