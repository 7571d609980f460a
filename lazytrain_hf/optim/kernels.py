"""The math of one AdamW step on a flat fp32 tensor with block-wise 8-bit moments: one fused pass per block.

Three implementations of the same step:

* ``native`` (default where a C compiler works and the CPU has AVX-512 VBMI): the C kernel of ``csrc/hybrid8bit.c``, built on first use and
  called through ctypes (native.py); AVX-512 in-register table lookups where the CPU has them. Bit-identical to
  the numba kernel for finite values.
* ``numba`` (numba_kernels.py, imported when it runs; the default where the native kernel lacks AVX-512, the
  fallback when its build fails): ``@njit(parallel=True, fastmath=False, cache=True, nogil=True)``,
  threads over chunks of blocks, the GIL released.
  Per block, in one visit of its elements while they sit in L1: dequantize m and v, scale the gradient by the
  clip coefficient, AdamW with decoupled weight decay and bias correction, find the block's new absmax, requantize
  m and v to the nearest code (a positive v never to code 0: the rule is in the lookup tables, Note: [A non-zero
  second moment keeps a non-zero code] in quant.py), write the fp32 master and, optionally, its bf16 copy. Memory traffic per element:
  read p, g (8 B) and two codes (2 B), write p (4 B), two codes (2 B) and the bf16 copy (2 B): 16-18 B instead
  of the 28 B of an fp32-state AdamW.
* ``torch`` (fallback, used when numba is missing or ``LAZYTRAIN_OPTIM_BACKEND=torch``): the same operations as
  whole-chunk torch ops, chunk by chunk to bound temporaries.

Both evaluate AdamW with the operations and operand order of ``torch.optim.AdamW`` (single-tensor), in float32:

    p  <- p * (1 - lr * wd)
    g  <- g * clip
    m  <- m + (1 - beta1) * (g - m)                     (lerp)
    v  <- v * beta2 + ((1 - beta2) * g) * g             (addcmul)
    p  <- p + ((-lr / bc1) * m) / (sqrt(v) / sqrt(bc2) + eps)

so they agree with each other up to floating-point contraction differences (a few ulp on p, and then at most one
code on the rare element that sits on a rounding midpoint); tests state the tolerance.
"""

from __future__ import annotations

import importlib.util
import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from . import native
from .quant import Quantized8bit

BACKENDS: tuple[str, ...] = ("native", "numba", "torch")
BACKEND_ENV = "LAZYTRAIN_OPTIM_BACKEND"

# Elements per unit of parallel work in the numba kernel: large enough that thread scheduling is negligible,
# small enough that 2-16 threads get balanced work on a single transformer layer.
CHUNK_ELEMENTS = 1 << 16
# Smaller tensors are updated by one thread (see Note: [Serial below a threshold]).
PARALLEL_MIN_ELEMENTS = 1 << 20
# Elements per torch-fallback chunk: bounds the fp32 temporaries (about 6 per element) to a few MiB.
TORCH_CHUNK_ELEMENTS = 1 << 20

# numba is a declared dependency, imported only when its backend runs (numba_kernels.py: ~33 MiB per process); the
# torch path keeps the optimizer usable where its wheel is missing
NUMBA_AVAILABLE = importlib.util.find_spec("numba") is not None


def resolve_backend(backend: str | None) -> str:
    """Pick the kernel backend: the argument, else ``$LAZYTRAIN_OPTIM_BACKEND``, else native -> numba -> torch.

    native is the default where its AVX-512 path runs (or numba is missing); on other CPUs numba is faster.

    The default builds the native kernel on first use (cached on disk); if that fails it warns once and uses numba.
    An explicitly requested backend that cannot run raises instead.
    """
    source = "backend"
    if backend is None:
        backend = os.environ.get(BACKEND_ENV) or None
        source = BACKEND_ENV
    if backend is None:
        if native.available():
            # The generic C path (no AVX-512) is slower than the numba kernel: prefer numba there.
            return "native" if native.isa() == "avx512" or not NUMBA_AVAILABLE else "numba"
        _warn_native_fallback()
        return "numba" if NUMBA_AVAILABLE else "torch"
    backend = str(backend).lower()
    if backend not in BACKENDS:
        raise ValueError(f"{source}={backend!r} is not a kernel backend; use one of {BACKENDS} (or leave it unset).")
    if backend == "numba" and not NUMBA_AVAILABLE:
        raise ImportError(f"{source}='numba' but numba is not importable; `pip install numba` or use backend='torch'.")
    if backend == "native" and not native.available():
        raise ImportError(f"{source}='native' but the C kernel could not be built: {native.error()}")
    return backend


_NATIVE_WARNED = False


def _warn_native_fallback() -> None:
    global _NATIVE_WARNED
    if not _NATIVE_WARNED:
        _NATIVE_WARNED = True
        fallback = "numba" if NUMBA_AVAILABLE else "torch"
        warnings.warn(
            f"lazytrain_hf: native optimizer kernel unavailable ({native.error()}); using {fallback}.", stacklevel=3
        )


@dataclass(frozen=True)
class AdamWScalars:
    """Per-call scalars of one AdamW step, computed in double precision as torch.optim.AdamW does.

    Attributes:
        decay: ``1 - lr * weight_decay`` (decoupled weight decay).
        one_minus_beta1: lerp weight of the first moment.
        beta2, one_minus_beta2: second-moment coefficients.
        neg_step_size: ``-lr / (1 - beta1**step)``.
        bias_correction2_sqrt: ``sqrt(1 - beta2**step)``.
        eps: added to the corrected ``sqrt(v)``.
        clip: gradient scale (the clip coefficient, 1.0 when not clipping).
    """

    decay: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    neg_step_size: float
    bias_correction2_sqrt: float
    eps: float
    clip: float

    @classmethod
    def make(
        cls, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int, clip: float = 1.0
    ) -> AdamWScalars:
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        return cls(
            decay=1 - lr * weight_decay,
            one_minus_beta1=1 - beta1,
            beta2=beta2,
            one_minus_beta2=1 - beta2,
            neg_step_size=-(lr / bias_correction1),
            bias_correction2_sqrt=math.sqrt(bias_correction2),
            eps=eps,
            clip=clip,
        )

    def as_float32(self) -> tuple[np.float32, ...]:
        # The kernels compute in float32 like torch's CPU kernels do with Python scalars (opmath of float).
        return tuple(
            np.float32(x)
            for x in (
                self.clip,
                self.decay,
                self.one_minus_beta1,
                self.beta2,
                self.one_minus_beta2,
                self.neg_step_size,
                self.bias_correction2_sqrt,
                self.eps,
            )
        )


# ----------------------------------------------------------------------------------------------------------------
# the numba backend (numba_kernels.py, imported on first use)
# ----------------------------------------------------------------------------------------------------------------

_WARM = False


def warm_up() -> None:
    """Compile (or load from numba's on-disk cache) the numba kernels once, so no step pays for it."""
    global _WARM
    if _WARM or not NUMBA_AVAILABLE:
        return
    from . import numba_kernels

    n = 300  # two blocks of 256 with a partial tail: every branch of the kernel
    p = torch.zeros(n)
    g = torch.ones(n)
    m = Quantized8bit.zeros(n, 256, signed=True)
    v = Quantized8bit.zeros(n, 256, signed=False)
    out = torch.empty(n, dtype=torch.bfloat16)
    adamw8bit_step(p, g, m, v, AdamWScalars.make(1e-3, 0.9, 0.999, 1e-8, 0.0, 1), out_bf16=out, backend="numba")
    adamw8bit_step(p, g, m, v, AdamWScalars.make(1e-3, 0.9, 0.999, 1e-8, 0.0, 2), out_bf16=None, backend="numba")
    # the multi-threaded entry point too (small tensors never reach it)
    numba_kernels.step(p, g, m, v, AdamWScalars.make(1e-3, 0.9, 0.999, 1e-8, 0.0, 3), out, True, 1)
    _WARM = True


def adamw8bit_step(
    p: torch.Tensor,
    g: torch.Tensor,
    m: Quantized8bit,
    v: Quantized8bit,
    scalars: AdamWScalars,
    out_bf16: torch.Tensor | None = None,
    backend: str = "numba",
) -> None:
    """One fused AdamW step on a flat contiguous fp32 tensor ``p`` with gradient ``g`` and 8-bit moments ``m``, ``v``.

    Updates ``p``, ``m`` and ``v`` in place; ``g`` is only read (the clip coefficient is applied on the fly). When
    ``out_bf16`` is given (a contiguous bf16 tensor of the same numel) it receives ``p.to(torch.bfloat16)``.
    """
    if backend == "native":
        # Thread-safe (no shared state between calls), so no lock; small tensors run on the calling thread.
        threads = torch.get_num_threads() if p.numel() >= PARALLEL_MIN_ELEMENTS else 1
        native.adamw8bit_step(
            p, g, m, v, scalars.as_float32(), out_bf16, threads, max(1, CHUNK_ELEMENTS // m.block_size)
        )
        return
    if backend == "numba":
        from . import numba_kernels  # imported on first use (why: its docstring)

        # Note: [Serial below a threshold] a parallel region costs far more than the update of a small tensor
        # (norms, biases, tiny layers), and wakes threads that compete with torch's own OpenMP pool.
        parallel = p.numel() >= PARALLEL_MIN_ELEMENTS
        numba_kernels.step(p, g, m, v, scalars, out_bf16, parallel, max(1, CHUNK_ELEMENTS // m.block_size))
        return
    _adamw8bit_torch(p, g, m, v, scalars, out_bf16)


def _adamw8bit_torch(
    p: torch.Tensor,
    g: torch.Tensor,
    m: Quantized8bit,
    v: Quantized8bit,
    scalars: AdamWScalars,
    out_bf16: torch.Tensor | None,
) -> None:
    bs = m.block_size
    chunk = max(bs, (TORCH_CHUNK_ELEMENTS // bs) * bs)
    n = p.numel()
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        b0, b1 = start // bs, -(-end // bs)
        pc, gc = p[start:end], g[start:end]
        mq = Quantized8bit(m.codes[start:end], m.absmax[b0:b1], bs, True, m.lookup)
        vq = Quantized8bit(v.codes[start:end], v.absmax[b0:b1], bs, False, v.lookup)
        mf, vf = mq.dequantize(), vq.dequantize()
        gs = gc * scalars.clip if scalars.clip != 1.0 else gc
        pc.mul_(scalars.decay)
        mf.lerp_(gs, scalars.one_minus_beta1)
        vf.mul_(scalars.beta2).addcmul_(gs, gs, value=scalars.one_minus_beta2)
        denom = (vf.sqrt() / scalars.bias_correction2_sqrt).add_(scalars.eps)
        pc.addcdiv_(mf, denom, value=scalars.neg_step_size)
        mq.quantize_(mf)
        vq.quantize_(vf)
        if out_bf16 is not None:
            out_bf16[start:end].copy_(pc)


def adamw32_step(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    scalars: AdamWScalars,
    out_bf16: torch.Tensor | None = None,
) -> None:
    """The fp32-state step for small tensors (under ``min_8bit_size``): torch ops, as torch.optim.AdamW."""
    gs = g * scalars.clip if scalars.clip != 1.0 else g
    p.mul_(scalars.decay)
    m.lerp_(gs, scalars.one_minus_beta1)
    v.mul_(scalars.beta2).addcmul_(gs, gs, value=scalars.one_minus_beta2)
    denom = (v.sqrt() / scalars.bias_correction2_sqrt).add_(scalars.eps)
    p.addcdiv_(m, denom, value=scalars.neg_step_size)
    if out_bf16 is not None:
        out_bf16.copy_(p)
