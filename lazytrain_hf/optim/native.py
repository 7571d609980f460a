"""The ``native`` backend of the fused 8-bit AdamW step: a C kernel built on first use and called through ctypes.

The source is ``csrc/hybrid8bit.c`` (its header comment describes the kernel). It is compiled with the system C
compiler (``$CC``, else ``cc``/``gcc``/``clang``) as

    cc -O3 -march=native -ffp-contract=off -fno-fast-math -std=gnu11 -shared -fPIC -pthread

and cached under ``$LAZYTRAIN_KERNEL_CACHE`` (default ``$XDG_CACHE_HOME/lazytrain_hf/kernels``, i.e.
``~/.cache/lazytrain_hf/kernels``) in a folder named by a hash of the source, the compiler's identity, the flags
and the CPU's feature flags, so a different machine or compiler builds its own copy. The library is written to a
temporary name and renamed into place, so concurrent processes never load a half-written file.

``-ffp-contract=off`` matters: it keeps the compiler from fusing multiply-adds, so the AdamW arithmetic is the
same float32 operations as the numba kernel and results are bit-identical to it (see the C file for the NaN
caveat). When no compiler is found or the build fails, `load()` returns None and `error()` says why; the backend
resolution in kernels.py then falls back to numba with a one-line warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from .quant import ABSMAX_FLOOR, CodeLookup, Quantized8bit

SOURCE = Path(__file__).with_name("csrc") / "hybrid8bit.c"
LIB_NAME = "libhybrid8bit.so"
CACHE_ENV = "LAZYTRAIN_KERNEL_CACHE"
# Set to "generic" to use the portable C path even on an AVX-512 CPU (tests compare the two).
ISA_ENV = "LAZYTRAIN_NATIVE_ISA"
CFLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fno-math-errno",
    "-std=gnu11",
    "-fvisibility=hidden",
)
LDFLAGS = ("-shared", "-fPIC", "-pthread", "-lm")
ABI_VERSION = 2
BUILD_TIMEOUT_S = 120


class _Args(ctypes.Structure):
    """Mirror of ``lt_args`` in hybrid8bit.c."""

    _fields_ = [
        ("p", ctypes.c_void_p),
        ("g", ctypes.c_void_p),
        ("m_codes", ctypes.c_void_p),
        ("m_absmax", ctypes.c_void_p),
        ("v_codes", ctypes.c_void_p),
        ("v_absmax", ctypes.c_void_p),
        ("out16", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("chunk_blocks", ctypes.c_int64),
        ("m_map", ctypes.c_void_p),
        ("m_bounds", ctypes.c_void_p),
        ("m_lut", ctypes.c_void_p),
        ("m_bmid", ctypes.c_void_p),
        ("v_map", ctypes.c_void_p),
        ("v_bounds", ctypes.c_void_p),
        ("v_lut", ctypes.c_void_p),
        ("v_bmid", ctypes.c_void_p),
        ("m_keytab", ctypes.c_void_p),
        ("m_lut8", ctypes.c_void_p),
        ("v_keytab", ctypes.c_void_p),
        ("v_lut8", ctypes.c_void_p),
        ("clip", ctypes.c_float),
        ("decay", ctypes.c_float),
        ("one_minus_beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("one_minus_beta2", ctypes.c_float),
        ("neg_step_size", ctypes.c_float),
        ("bias_correction2_sqrt", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("absmax_floor", ctypes.c_float),
        ("num_threads", ctypes.c_int32),
        ("isa", ctypes.c_int32),
    ]


_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_ERROR: str | None = None
_TRIED = False


def cache_dir() -> Path:
    """Root of the kernel cache (see the module docstring)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lazytrain_hf" / "kernels"


def find_compiler() -> str | None:
    """``$CC`` if set (may be empty to disable the build), else the first of cc, gcc, clang on PATH."""
    if "CC" in os.environ:
        cc = os.environ["CC"].strip()
        return shutil.which(cc) if cc else None
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler_id(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else cc
    except (OSError, subprocess.SubprocessError):
        return cc


def _build(cc: str, src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=dst.parent)
    os.close(fd)
    try:
        cmd = [cc, *CFLAGS, *LDFLAGS, str(src), "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if res.returncode != 0 and "-march=native" in cmd:  # compilers without -march=native
            cmd.remove("-march=native")
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if res.returncode != 0:
            lines = (res.stderr or res.stdout).strip().splitlines()
            errors = [ln for ln in lines if "error" in ln] or lines or [f"exit {res.returncode}"]
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {errors[0]}")
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path(cc: str) -> Path:
    """Where the library for this source, compiler and CPU lives in the cache."""
    h = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        _compiler_id(cc).encode(),
        " ".join(CFLAGS + LDFLAGS).encode(),
        _cpu_flags().encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / h.hexdigest()[:16] / LIB_NAME


def load() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None when it cannot be built (see `error()`)."""
    global _LIB, _ERROR, _TRIED
    if _TRIED:
        return _LIB
    with _LOCK:
        if _TRIED:
            return _LIB
        try:
            cc = find_compiler()
            if cc is None:
                raise RuntimeError("no C compiler found (set CC or install gcc)")
            path = library_path(cc)
            if not path.exists():
                _build(cc, SOURCE, path)
            lib = ctypes.CDLL(str(path))
            if lib.lt_abi_version() != ABI_VERSION:
                raise RuntimeError(f"{path} has ABI {lib.lt_abi_version()}, expected {ABI_VERSION}")
            lib.lt_adamw8bit_step.argtypes = [ctypes.POINTER(_Args)]
            lib.lt_adamw8bit_step.restype = ctypes.c_int
            lib.lt_has_avx512.restype = ctypes.c_int
            _LIB = lib
        except Exception as exc:  # any failure means "not available": the caller falls back
            _ERROR = f"{type(exc).__name__}: {exc}"
            _LIB = None
        _TRIED = True
    return _LIB


def error() -> str | None:
    """Why `load()` returned None (None when it did not, or was not called)."""
    return _ERROR


def reset() -> None:
    """Forget the loaded library so the next `load()` tries again (tests; the loaded .so stays mapped)."""
    global _LIB, _ERROR, _TRIED
    with _LOCK:
        _LIB, _ERROR, _TRIED = None, None, False


def available() -> bool:
    return load() is not None


def isa() -> str:
    """The code path the kernel takes on this CPU: "avx512" or "generic"."""
    lib = load()
    if lib is None:
        return "unavailable"
    if os.environ.get(ISA_ENV, "").lower() == "generic":
        return "generic"
    return "avx512" if lib.lt_has_avx512() else "generic"


def _ordered(x: np.ndarray) -> np.ndarray:
    """Order-preserving int64 image of float32 values (the integer compare of the kernel's bucket keys)."""
    b = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
    return np.where(b < 0, b ^ 0x7FFFFFFF, b)


# id(lookup) -> (lookup, tables): holding the lookup keeps its id from being reused by another object.
_KEYS: dict[int, tuple[CodeLookup, tuple[np.ndarray, np.ndarray] | None]] = {}


def bucket_keys(lookup: CodeLookup) -> tuple[np.ndarray, np.ndarray] | None:
    """Tables of the AVX-512 encode (``encode64`` in hybrid8bit.c) for one code map; None if the map does not fit.

    Values in [-1, 1] fall in 64 exponent groups in increasing order: 32 negative (exponents 127 down to 96, the
    last also taking every smaller magnitude), then 32 positive (96 up to 127). Group ``j`` is split into
    ``2**b`` buckets by the top ``b`` of the low 23 bits of the order-preserving integer image of the float, with
    the smallest ``b`` that leaves at most two midpoints in any bucket; neighbouring buckets with no midpoint
    between them share one key. Returns ``keytab`` (int32[64]: first key of group j plus its shift ``23 - b``
    in bits 16 and up) and ``lut8`` (uint8[256]: for each key, the number of midpoints below the bucket's lowest
    value). The kernel's code is ``lut8[key] + (x > bounds[lut8[key]]) + (x > bounds[lut8[key] + 1])``: exact
    because the two midpoints compared are the only ones that can lie in the bucket.
    """
    cached = _KEYS.get(id(lookup))
    if cached is not None:
        return cached[1]
    mids = _ordered(lookup.bounds[:255])
    keytab = np.zeros(64, np.int32)
    lut: list[int] = []
    result: tuple[np.ndarray, np.ndarray] | None = None
    for j in range(64):
        neg = j < 32
        e = 127 - j if neg else j - 32 + 96
        group_base = (-(e + 1)) << 23 if neg else e << 23
        for b in range(9):
            shift = 23 - b
            lo = group_base + (np.arange(1 << b, dtype=np.int64) << shift)
            hi = lo + (1 << shift) - 1
            if e == 96:  # also every magnitude below 2**-30: one range from the group's end to zero
                lo, hi = (lo, np.array([-1])) if neg else (np.array([0]), hi)
            inside = np.searchsorted(mids, hi, side="right") - np.searchsorted(mids, lo, side="left")
            if inside.max() <= 2:
                break
        else:
            break
        below = np.searchsorted(mids, lo, side="left")
        if b == 0 and lut and lut[-1] == below[0]:
            keytab[j] = len(lut) - 1 + (23 << 16)
            continue
        keytab[j] = len(lut) + (shift << 16)
        lut += below.tolist()
    else:
        if len(lut) <= 256:
            result = (keytab, np.array(lut + [0] * (256 - len(lut)), np.uint8))
    _KEYS[id(lookup)] = (lookup, result)
    return result


def adamw8bit_step(
    p: torch.Tensor,
    g: torch.Tensor,
    m: Quantized8bit,
    v: Quantized8bit,
    scalars: tuple,
    out_bf16: torch.Tensor | None,
    num_threads: int,
    chunk_blocks: int,
) -> None:
    """Run the kernel; ``scalars`` is `AdamWScalars.as_float32()`. Tensors must be flat, contiguous and on CPU."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"native optimizer kernel unavailable: {_ERROR}")
    n = p.numel()
    for name, t, dtype in (
        ("p", p, torch.float32),
        ("g", g, torch.float32),
        ("exp_avg codes", m.codes, torch.uint8),
        ("exp_avg_sq codes", v.codes, torch.uint8),
    ):
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n:
            raise ValueError(
                f"native kernel: {name} must be a contiguous CPU {dtype} tensor of {n} elements; got {t.dtype} "
                f"on {t.device} with {t.numel()} elements (contiguous={t.is_contiguous()})."
            )
    if out_bf16 is not None and (
        out_bf16.dtype != torch.bfloat16 or not out_bf16.is_contiguous() or out_bf16.numel() != n
    ):
        raise ValueError("native kernel: out_bf16 must be a contiguous bfloat16 tensor of the same numel as p.")
    if m.block_size != v.block_size or not m.absmax.is_contiguous() or not v.absmax.is_contiguous():
        raise ValueError("native kernel: exp_avg and exp_avg_sq need the same block_size and contiguous absmax.")
    clip, decay, w1, b2, w2, neg_step, bc2s, eps = (float(x) for x in scalars)
    ml, vl = m.lookup, v.lookup
    mk, vk = bucket_keys(ml), bucket_keys(vl)
    args = _Args(
        p.data_ptr(),
        g.data_ptr(),
        m.codes.data_ptr(),
        m.absmax.data_ptr(),
        v.codes.data_ptr(),
        v.absmax.data_ptr(),
        out_bf16.data_ptr() if out_bf16 is not None else None,
        n,
        m.block_size,
        max(1, int(chunk_blocks)),
        ml.code_map.ctypes.data,
        ml.bounds.ctypes.data,
        ml.lut.ctypes.data,
        ml.bucket_mid.ctypes.data,
        vl.code_map.ctypes.data,
        vl.bounds.ctypes.data,
        vl.lut.ctypes.data,
        vl.bucket_mid.ctypes.data,
        mk[0].ctypes.data if mk else None,
        mk[1].ctypes.data if mk else None,
        vk[0].ctypes.data if vk else None,
        vk[1].ctypes.data if vk else None,
        clip,
        decay,
        w1,
        b2,
        w2,
        neg_step,
        bc2s,
        eps,
        ABSMAX_FLOOR,
        max(1, int(num_threads)),
        0 if os.environ.get(ISA_ENV, "").lower() == "generic" else 1,
    )
    rc = lib.lt_adamw8bit_step(ctypes.byref(args))
    if rc != 0:
        raise ValueError(f"native kernel rejected its arguments (code {rc}): n={n}, block_size={m.block_size}.")
