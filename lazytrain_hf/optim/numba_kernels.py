"""The numba backend of the 8-bit AdamW step (`kernels.adamw8bit_step` with ``backend="numba"``; the algorithm and
its operand order are in kernels.py's docstring).

Imported only when that backend runs (`kernels.resolve_backend` chose it, or it was asked for): numba and llvmlite
take ~33 MiB of every process that imports them (PSS, measured 2026-12-03), paid by each data-parallel rank, while the
native kernel, the default on AVX-512 machines, needs neither. ``@njit(parallel=True, fastmath=False, cache=True,
nogil=True)``: threads over chunks of blocks, the GIL released.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from numba import njit, prange

from .quant import ABSMAX_FLOOR, LOOKUP_SHIFT, Quantized8bit, num_blocks

# Note: [One kernel call at a time] numba's default "workqueue" threading layer is not safe for concurrent
# parallel regions from several Python threads; the runtime may update layers from a background thread while the
# main thread also steps, so kernel calls are serialised with this lock (the kernel itself is multi-threaded).
KERNEL_LOCK = threading.Lock()


# Note: [Scalar table lookups] error_model="numpy" drops Python's division-by-zero check, which otherwise
# keeps LLVM from vectorizing the AdamW loop. The four table lookups per element (dequantize m and v, code
# lookup for m and v) are left as scalar loops on purpose: on the AMD EPYC (Zen 4) development machines a
# vectorized gather costs ~2.5 cycles per element against ~1.2 for a scalar load, and LLVM only vectorizes
# them when it can prove the destination does not alias the table (it cannot for heap scratch buffers).


# nogil: the optimizer thread updates layers while the training thread runs the next forward; a kernel that held
# the GIL would stall every kernel launch and hook of that forward for the whole update
@njit(fastmath=False, error_model="numpy", cache=True, nogil=True)
def update_blocks(
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
def adamw8bit_parallel(
    p, p_bits, g, m_codes, m_absmax, v_codes, v_absmax, m_map, m_lut, m_bmid, v_map, v_lut, v_bmid, block_size,
    hp, out16, write16, chunk_blocks,
):  # fmt: skip  # pragma: no cover - compiled
    """`update_blocks` over every block, chunks of ``chunk_blocks`` blocks spread over numba's threads."""
    n_blocks = (p.shape[0] + block_size - 1) // block_size
    n_chunks = (n_blocks + chunk_blocks - 1) // chunk_blocks
    for c in prange(n_chunks):
        update_blocks(
            c * chunk_blocks, min((c + 1) * chunk_blocks, n_blocks), p, p_bits, g, m_codes, m_absmax, v_codes,
            v_absmax, m_map, m_lut, m_bmid, v_map, v_lut, v_bmid, block_size, hp, out16, write16,
        )  # fmt: skip


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def numba_args(p, g, m: Quantized8bit, v: Quantized8bit, scalars, out_bf16) -> tuple:
    """Arguments of `update_blocks` after its block range (and of `adamw8bit_parallel` before chunk_blocks)."""
    hp = np.array([*scalars.as_float32(), ABSMAX_FLOOR], np.float32)
    out16 = out_bf16.view(torch.int16).numpy().view(np.uint16) if out_bf16 is not None else np.empty(0, np.uint16)
    pn, ml, vl = as_numpy(p), m.lookup, v.lookup
    return (
        pn, pn.view(np.uint32), as_numpy(g), m.codes.numpy(), m.absmax.numpy(), v.codes.numpy(), v.absmax.numpy(),
        ml.code_map, ml.lut, ml.bucket_mid, vl.code_map, vl.lut, vl.bucket_mid, m.block_size, hp, out16,
        out_bf16 is not None,
    )  # fmt: skip


def step(p, g, m: Quantized8bit, v: Quantized8bit, scalars, out_bf16, parallel: bool, chunk_blocks: int) -> None:
    """One step (`kernels.adamw8bit_step`): over every block on numba's threads in chunks of ``chunk_blocks`` blocks
    when ``parallel``, else on the calling thread; one kernel call at a time (`KERNEL_LOCK`)."""
    with KERNEL_LOCK:
        args = numba_args(p, g, m, v, scalars, out_bf16)
        if parallel:
            adamw8bit_parallel(*args, chunk_blocks)
        else:
            update_blocks(0, num_blocks(p.numel(), m.block_size), *args)
