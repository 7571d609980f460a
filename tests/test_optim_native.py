"""The native (C) backend of HybridAdamW8bit against the numba backend, and its build-failure fallback.

Both backends evaluate the same float32 operations in the same order without multiply-add contraction, so for
finite data the results are expected to be bit-identical: parameters, codes, absmax and the bf16 copy.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from lazytrain_hf.optim import HybridAdamW8bit, Quantized8bit, native
from lazytrain_hf.optim import kernels as K
from lazytrain_hf.optim.kernels import NUMBA_AVAILABLE, AdamWScalars, adamw8bit_step, resolve_backend
from lazytrain_hf.optim.quant import dynamic_lookup

pytestmark = [
    pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: {native.error()}"),
    pytest.mark.skipif(not NUMBA_AVAILABLE, reason="numba not installed (the reference backend)"),
]

ISAS = ["generic"] + (["avx512"] if native.isa() == "avx512" else [])


def _run(backend, n, block_size=256, steps=3, weight_decay=0.1, clip=0.7, bf16=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m, v = Quantized8bit.zeros(n, block_size, True), Quantized8bit.zeros(n, block_size, False)
    out = torch.empty(n, dtype=torch.bfloat16) if bf16 else None
    for step in range(1, steps + 1):
        # Heavy-tailed gradients: moments span many decades, so every exponent group of the code maps is hit.
        g = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 2) * 1e-2
        adamw8bit_step(p, g, m, v, AdamWScalars.make(1e-3, 0.9, 0.999, 1e-8, weight_decay, step, clip), out, backend)
        if bf16:
            assert torch.equal(out.view(torch.int16), p.to(torch.bfloat16).view(torch.int16)), backend
    return p, m, v, out


def _assert_identical(a, b):
    pa, ma, va, oa = a
    pb, mb, vb, ob = b
    assert torch.equal(pa.view(torch.int32), pb.view(torch.int32)), (pa != pb).sum().item()
    for qa, qb in ((ma, mb), (va, vb)):
        assert torch.equal(qa.codes, qb.codes), (qa.codes != qb.codes).sum().item()
        assert torch.equal(qa.absmax.view(torch.int32), qb.absmax.view(torch.int32))
    if oa is not None:
        assert torch.equal(oa.view(torch.int16), ob.view(torch.int16))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    "n, block_size",
    [
        (1, 256),  # a single element
        (300, 256),  # one full block and a partial one
        (256 * 37 + 129, 256),
        (5000, 64),
        (1000, 48),  # block not a multiple of the vector width
        (777, 16),
        (70_000, 4096),
        ((1 << 20) + 77, 256),  # multi-threaded path, partial last block
    ],
)
def test_native_bit_identical_to_numba(monkeypatch, isa, n, block_size):
    monkeypatch.setenv(native.ISA_ENV, isa)
    _assert_identical(_run("native", n, block_size), _run("numba", n, block_size))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("weight_decay, clip, bf16", [(0.0, 1.0, False), (0.3, 0.05, True), (0.01, 1.0, True)])
def test_native_hyperparameters(monkeypatch, isa, weight_decay, clip, bf16):
    monkeypatch.setenv(native.ISA_ENV, isa)
    kw = {"weight_decay": weight_decay, "clip": clip, "bf16": bf16, "steps": 4}
    _assert_identical(_run("native", 256 * 50 + 3, **kw), _run("numba", 256 * 50 + 3, **kw))


@pytest.mark.parametrize("isa", ISAS)
def test_native_codes_are_bucketize_on_ties(monkeypatch, isa):
    """Scaled values exactly on midpoints and one ulp around them: codes equal torch.bucketize (ties down)."""
    monkeypatch.setenv(native.ISA_ENV, isa)
    lk = dynamic_lookup(True)
    mids = lk.mids_t
    vals = torch.cat(
        [mids, torch.nextafter(mids, torch.full_like(mids, 2.0)), torch.nextafter(mids, torch.full_like(mids, -2.0))]
    )
    vals = torch.cat([vals, torch.tensor([0.0, -0.0, 1e-40, -1e-40, 2.0**-31, -(2.0**-31), -1.0])])
    # Squares far below the first midpoint of the unsigned map (down to a denormal, 1e-20 ** 2): code 1, not 0.
    # First, so that they fall in whole vectors (the AVX-512 encode) as well as in the tail.
    tiny = torch.tensor([1e-5, -2e-4, 4e-4, 4.03e-4, 1e-20, -1e-20, 3e-23])
    vals = torch.cat([tiny, vals, tiny])
    vals = vals.clamp(-1, 1)
    blocks = vals.split(255)
    # Each block gets a 1.0 element: absmax 1, so the scaled value of every element is the value itself.
    g = torch.cat([torch.cat([b, torch.ones(1)]) for b in blocks])
    n = g.numel()
    p = torch.zeros(n)
    m, v = Quantized8bit.zeros(n, 256, True), Quantized8bit.zeros(n, 256, False)
    # m starts at 0, so m_new = 0 + 1 * (g - 0) = g exactly; v_new = g * g.
    s = AdamWScalars(
        decay=1.0, one_minus_beta1=1.0, beta2=0.0, one_minus_beta2=1.0, neg_step_size=0.0,
        bias_correction2_sqrt=1.0, eps=1.0, clip=1.0,
    )  # fmt: skip
    adamw8bit_step(p, g, m, v, s, None, "native")
    expected = torch.bucketize(g, mids).to(torch.uint8)
    assert torch.equal(m.codes, expected), (m.codes != expected).nonzero()[:5].flatten().tolist()
    # v_new = 0 * 0 + (1 * g) * g and every block's absmax is 1: the scaled value is g * g.
    v_expected = torch.bucketize(g * g, dynamic_lookup(False).mids_t).to(torch.uint8)
    assert torch.equal(v.codes, v_expected)
    assert v.codes[g * g > 0].ge(1).all() and v.codes[g * g == 0].eq(0).all()


@pytest.mark.parametrize("isa", ISAS)
def test_block_extremes_get_the_end_codes(monkeypatch, isa):
    """The element equal to +-absmax scales to a * (1 / a), which rounds to 1 or to the float just below it (never
    above: the AVX-512 path relies on it and does not clamp); it must take the end code, as in the numba kernel."""
    monkeypatch.setenv(native.ISA_ENV, isa)
    cand = torch.rand(200_000, generator=torch.Generator().manual_seed(5)) * 1e3 + 1e-3
    scaled = cand * (1.0 / cand)
    assert scaled.max().item() == 1.0 and scaled.min().item() == float(np.nextafter(np.float32(1), np.float32(0)))
    below = cand[scaled < 1.0][:20]
    exact = cand[scaled == 1.0][:20]
    gen = torch.Generator().manual_seed(3)
    blocks = []
    for i, a in enumerate(torch.cat([below, exact]).tolist()):
        body = (torch.rand(255, generator=gen) * 2 - 1) * a * 0.99
        blocks.append(torch.cat([body, torch.tensor([a if i % 2 == 0 else -a])]))
    g = torch.cat(blocks)
    n = g.numel()
    s = AdamWScalars(
        decay=1.0, one_minus_beta1=1.0, beta2=0.0, one_minus_beta2=1.0, neg_step_size=0.0,
        bias_correction2_sqrt=1.0, eps=1.0, clip=1.0,
    )  # fmt: skip
    results = []
    for backend in ("native", "numba"):
        m, v = Quantized8bit.zeros(n, 256, True), Quantized8bit.zeros(n, 256, False)
        adamw8bit_step(torch.zeros(n), g, m, v, s, None, backend)  # m_new = g, v_new = g * g
        results.append((m.codes, v.codes))
    (mc, vc), (mc_ref, vc_ref) = results
    assert torch.equal(mc, mc_ref) and torch.equal(vc, vc_ref)
    ends = mc[255::256]
    assert ends[0::2].eq(255).all() and ends[1::2].eq(0).all(), ends.tolist()
    assert vc[255::256].eq(255).all()


def test_bucket_keys_fit_and_cover():
    for signed in (True, False):
        keys = native.bucket_keys(dynamic_lookup(signed))
        assert keys is not None
        keytab, lut8 = keys
        assert keytab.shape == (64,) and lut8.shape == (256,) and np.all(np.diff(keytab & 0xFFFF) >= 0)


def test_optimizer_default_and_native_matches_numba(monkeypatch):
    monkeypatch.delenv(K.BACKEND_ENV, raising=False)
    assert resolve_backend(None) == ("native" if native.isa() == "avx512" else "numba")
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(96, 80))
    b = torch.nn.Parameter(a.detach().clone())
    ours = HybridAdamW8bit([a], lr=1e-2, weight_decay=0.05, min_8bit_size=1024, backend="native")
    ref = HybridAdamW8bit([b], lr=1e-2, weight_decay=0.05, min_8bit_size=1024, backend="numba")
    assert ours.backend == "native" and "backend: native" in repr(ours)
    for _ in range(5):
        g = torch.randn(96, 80)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.equal(a, b)


def test_build_failure_falls_back_to_numba_with_warning(monkeypatch, tmp_path):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CC", "")  # no compiler
    monkeypatch.delenv(K.BACKEND_ENV, raising=False)
    monkeypatch.setattr(K, "_NATIVE_WARNED", False)
    native.reset()
    try:
        assert not native.available() and "no C compiler" in native.error()
        with pytest.warns(UserWarning, match="native optimizer kernel unavailable"):
            assert resolve_backend(None) == "numba"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert resolve_backend(None) == "numba"  # warned once
        with pytest.raises(ImportError, match="native"):
            resolve_backend("native")
        # A compiler that fails: the error names the command.
        monkeypatch.setenv("CC", "false")
        native.reset()
        assert not native.available() and "failed" in native.error()
    finally:
        monkeypatch.undo()
        native.reset()
    assert native.available()


def test_build_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    native.reset()
    try:
        assert native.available()
        built = list(tmp_path.rglob(native.LIB_NAME))
        assert len(built) == 1 and not list(tmp_path.rglob(".build-*"))
        mtime = built[0].stat().st_mtime_ns
        native.reset()
        assert native.available() and built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt
    finally:
        monkeypatch.undo()
        native.reset()


def test_numba_is_imported_only_when_its_backend_runs():
    """The package and a native-backend optimizer step import no numba (numba and llvmlite take ~33 MiB of every
    process, each data-parallel rank's included); the numba backend imports it on first use."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from lazytrain_hf import LazyTrainer\n"
        "from lazytrain_hf.optim import HybridAdamW8bit\n"
        "p = torch.nn.Parameter(torch.randn(4096))\n"
        "opt = HybridAdamW8bit([p], lr=1e-3, backend='native')\n"
        "p.grad = torch.randn(4096)\n"
        "opt.step()\n"
        "assert 'numba' not in sys.modules, 'numba imported by the package or the native backend'\n"
        "if len(sys.argv) > 1:\n"
        "    HybridAdamW8bit([p], lr=1e-3, backend='numba').step()\n"
        "    assert 'numba' in sys.modules\n"
    )
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.error()}")
    args = [sys.executable, "-c", code] + (["numba"] if NUMBA_AVAILABLE else [])
    root = __import__("pathlib").Path(__file__).resolve().parents[1]  # `-c` puts the working directory first
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
