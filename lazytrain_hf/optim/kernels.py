"""The math of one AdamW step on a flat fp32 tensor with block-wise 8-bit moments: one fused pass per block.

Three implementations of the same step:

* ``native`` (default where a C compiler works and the CPU has AVX-512 VBMI): the C kernel of ``csrc/hybrid8bit.c``, built on first use and
  called through ctypes (native.py); AVX-512 in-register table lookups where the CPU has them. Bit-identical to
  the numba kernel for finite values.
* ``numba`` (fallback when the native build fails): ``@njit(parallel=True, fastmath=False, cache=True, nogil=True)``,
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

import math
import os
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from . import native
from .quant import ABSMAX_FLOOR, LOOKUP_SHIFT, Quantized8bit, num_blocks

BACKENDS: tuple[str, ...] = ("native", "numba", "torch")
BACKEND_ENV = "LAZYTRAIN_OPTIM_BACKEND"

# Elements per unit of parallel work in the numba kernel: large enough that thread scheduling is negligible,
# small enough that 2-16 threads get balanced work on a single transformer layer.
CHUNK_ELEMENTS = 1 << 16
# Smaller tensors are updated by one thread (see Note: [Serial below a threshold]).
PARALLEL_MIN_ELEMENTS = 1 << 20
# Elements per torch-fallback chunk: bounds the fp32 temporaries (about 6 per element) to a few MiB.
TORCH_CHUNK_ELEMENTS = 1 << 20

try:  # numba is a declared dependency; the torch path keeps the optimizer usable where its wheel is missing.
    import numba
    from numba import njit, prange

    NUMBA_AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only on machines without numba
    numba = None
    NUMBA_AVAILABLE = False

# Note: [One kernel call at a time] numba's default "workqueue" threading layer is not safe for concurrent
# parallel regions from several Python threads; the runtime may update layers from a background thread while the
# main thread also steps, so kernel calls are serialised with this lock (the kernel itself is multi-threaded).
_KERNEL_LOCK = threading.Lock()


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
# numba fast path
# ----------------------------------------------------------------------------------------------------------------

if NUMBA_AVAILABLE:
    # Note: [Scalar table lookups] error_model="numpy" drops Python's division-by-zero check, which otherwise
    # keeps LLVM from vectorizing the AdamW loop. The four table lookups per element (dequantize m and v, code
    # lookup for m and v) are left as scalar loops on purpose: on the AMD EPYC (Zen 4) development machines a
    # vectorized gather costs ~2.5 cycles per element against ~1.2 for a scalar load, and LLVM only vectorizes
    # them when it can prove the destination does not alias the table (it cannot for heap scratch buffers).

    # nogil: the optimizer thread updates layers while the training thread runs the next forward; a kernel that held
    # the GIL would stall every kernel launch and hook of that forward for the whole update
    @njit(fastmath=False, error_model="numpy", cache=True, nogil=True)
    def _update_blocks(
        b0,
        b1,
        p,
        p_bits,
        g,
        m_codes,
        m_absmax,
        v_codes,
        v_absmax,
        m_map,
        m_lut,
        m_bmid,
        v_map,
        v_lut,
        v_bmid,
        block_size,
        hp,
        out16,
        write16,
    ):  # pragma: no cover - compiled
        """Blocks ``b0 .. b1 - 1`` of the fused step (see the module docstring); one thread. ``hp``: the float32
        scalars clip, decay, 1 - beta1, beta2, 1 - beta2, -step size, sqrt(bias correction 2), eps, absmax floor."""
        clip, decay, one_minus_beta1, beta2, one_minus_beta2 = hp[0], hp[1], hp[2], hp[3], hp[4]
        neg_step_size, bias_correction2_sqrt, eps, absmax_floor = hp[5], hp[6], hp[7], hp[8]
        n = p.shape[0]
        one = np.float32(1.0)
        # Scratch for one block; the uint32 views give the float bits that the absmax reduction and the code
        # lookup work on.
        mbuf = np.empty(block_size, np.float32)
        vbuf = np.empty(block_size, np.float32)
        mbits = mbuf.view(np.uint32)
        vbits = vbuf.view(np.uint32)
        maxbits = np.empty(2, np.uint32)
        maxvals = maxbits.view(np.float32)
        for b in range(b0, b1):
            s = b * block_size
            e = min(s + block_size, n)
            length = e - s
            # Slices, not p[s + i]: a possibly negative index makes numba emit a wraparound select that
            # keeps LLVM from seeing contiguous accesses.
            ps = p[s:e]
            gs = g[s:e]
            mcs = m_codes[s:e]
            vcs = v_codes[s:e]
            am = m_absmax[b]
            av = v_absmax[b]
            # Dequantize (scalar lookups, see the note above).
            for i in range(length):
                mbuf[i] = m_map[mcs[i]]
                vbuf[i] = v_map[vcs[i]]
            # Clip and AdamW, in the operand order of torch.optim.AdamW (see module docstring). Vectorized.
            for i in range(length):
                gi = gs[i] * clip
                mi = mbuf[i] * am
                vi = vbuf[i] * av
                mi = mi + one_minus_beta1 * (gi - mi)
                vi = vi * beta2 + (one_minus_beta2 * gi) * gi
                denom = np.sqrt(vi) / bias_correction2_sqrt + eps
                ps[i] = ps[i] * decay + (neg_step_size * mi) / denom
                mbuf[i] = mi
                vbuf[i] = vi
            # New absmax: for non-negative floats the bit patterns order like the values, and an integer
            # max reduction vectorizes without fast-math.
            mmax = np.uint32(0)
            vmax = np.uint32(0)
            for i in range(length):
                mmax = max(mmax, mbits[i] & np.uint32(0x7FFFFFFF))
                vmax = max(vmax, vbits[i] & np.uint32(0x7FFFFFFF))
            maxbits[0] = mmax
            maxbits[1] = vmax
            m_absmax[b] = maxvals[0]
            v_absmax[b] = maxvals[1]
            m_inv = one / max(maxvals[0], absmax_floor)
            v_inv = one / max(maxvals[1], absmax_floor)
            # Scale into [-1, 1] as bitsandbytes' reference does: x * (1 / absmax), clamped. Vectorized.
            for i in range(length):
                mbuf[i] = min(max(mbuf[i] * m_inv, -one), one)
                vbuf[i] = min(max(vbuf[i] * v_inv, -one), one)
            # Nearest code: the bucket's base code plus one if x lies above the bucket's midpoint (quant.py).
            for i in range(length):
                km = mbits[i] >> LOOKUP_SHIFT
                kv = vbits[i] >> LOOKUP_SHIFT
                mcs[i] = m_lut[km] + (mbuf[i] > m_bmid[km])
                vcs[i] = v_lut[kv] + (vbuf[i] > v_bmid[kv])
            if write16:
                pbs = p_bits[s:e]
                os16 = out16[s:e]
                for i in range(length):
                    bits = pbs[i]
                    # Round to nearest even, NaN to the canonical quiet NaN, as c10::BFloat16 does.
                    r = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
                    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                        r = np.uint32(0x7FC0)
                    os16[i] = np.uint16(r)

    @njit(parallel=True, fastmath=False, error_model="numpy", cache=True, nogil=True)
    def _adamw8bit_parallel(
        p, p_bits, g, m_codes, m_absmax, v_codes, v_absmax, m_map, m_lut, m_bmid, v_map, v_lut, v_bmid, block_size,
        hp, out16, write16, chunk_blocks,
    ):  # fmt: skip  # pragma: no cover - compiled
        """`_update_blocks` over every block, chunks of ``chunk_blocks`` blocks spread over numba's threads."""
        n_blocks = (p.shape[0] + block_size - 1) // block_size
        n_chunks = (n_blocks + chunk_blocks - 1) // chunk_blocks
        for c in prange(n_chunks):
            _update_blocks(
                c * chunk_blocks, min((c + 1) * chunk_blocks, n_blocks), p, p_bits, g, m_codes, m_absmax, v_codes,
                v_absmax, m_map, m_lut, m_bmid, v_map, v_lut, v_bmid, block_size, hp, out16, write16,
            )  # fmt: skip


_WARM = False


def warm_up() -> None:
    """Compile (or load from numba's on-disk cache) the kernels once, so no step pays for it."""
    global _WARM
    if _WARM or not NUMBA_AVAILABLE:
        return
    n = 300  # two blocks of 256 with a partial tail: every branch of the kernel
    p = torch.zeros(n)
    g = torch.ones(n)
    m = Quantized8bit.zeros(n, 256, signed=True)
    v = Quantized8bit.zeros(n, 256, signed=False)
    out = torch.empty(n, dtype=torch.bfloat16)
    adamw8bit_step(p, g, m, v, AdamWScalars.make(1e-3, 0.9, 0.999, 1e-8, 0.0, 1), out_bf16=out, backend="numba")
    adamw8bit_step(p, g, m, v, AdamWScalars.make(1e-3, 0.9, 0.999, 1e-8, 0.0, 2), out_bf16=None, backend="numba")
    with _KERNEL_LOCK:  # the multi-threaded entry point too (small tensors never reach it)
        _adamw8bit_parallel(*_numba_args(p, g, m, v, AdamWScalars.make(1e-3, 0.9, 0.999, 1e-8, 0.0, 3), out), 1)
    _WARM = True


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def _numba_args(p, g, m: Quantized8bit, v: Quantized8bit, scalars: AdamWScalars, out_bf16) -> tuple:
    """Arguments of `_update_blocks` after its block range (and of `_adamw8bit_parallel` before chunk_blocks)."""
    hp = np.array([*scalars.as_float32(), ABSMAX_FLOOR], np.float32)
    out16 = out_bf16.view(torch.int16).numpy().view(np.uint16) if out_bf16 is not None else np.empty(0, np.uint16)
    pn, ml, vl = _as_numpy(p), m.lookup, v.lookup
    return (
        pn, pn.view(np.uint32), _as_numpy(g), m.codes.numpy(), m.absmax.numpy(), v.codes.numpy(), v.absmax.numpy(),
        ml.code_map, ml.lut, ml.bucket_mid, vl.code_map, vl.lut, vl.bucket_mid, m.block_size, hp, out16,
        out_bf16 is not None,
    )  # fmt: skip


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
        with _KERNEL_LOCK:
            args = _numba_args(p, g, m, v, scalars, out_bf16)
            # Note: [Serial below a threshold] a parallel region costs far more than the update of a small tensor
            # (norms, biases, tiny layers), and wakes threads that compete with torch's own OpenMP pool.
            if p.numel() >= PARALLEL_MIN_ELEMENTS:
                _adamw8bit_parallel(*args, max(1, CHUNK_ELEMENTS // m.block_size))
            else:
                _update_blocks(0, num_blocks(p.numel(), m.block_size), *args)
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
