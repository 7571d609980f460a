"""HybridAdamW8bit: quantisation against bitsandbytes, trajectories against torch.optim.AdamW, state dicts, entry points.

Tolerances, and why:
- fp32-state tensors (under min_8bit_size) run torch's own ops in torch's order: bit-identical to AdamW(foreach=False).
- 8-bit moments change the update by the quantisation error of m and v; after N steps of a random problem the
  parameters stay within 8% of the distance AdamW moved them (measured up to 4.8% after 100 least-squares steps,
  growing slowly), and losses within 3% (measured up to 1.4%).
- numba vs torch backends: same math, but torch's vectorized kernels contract some multiply-adds (a few ulp); codes
  then differ by at most one on elements sitting on a rounding midpoint (< 0.1% of them).
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from lazytrain_hf.optim import HybridAdamW8bit, Quantized8bit, create_dynamic_map, native
from lazytrain_hf.optim.kernels import NUMBA_AVAILABLE, AdamWScalars, adamw8bit_step, resolve_backend
from lazytrain_hf.optim.quant import dynamic_lookup

BACKENDS = ["torch"] + (["numba"] if NUMBA_AVAILABLE else []) + (["native"] if native.available() else [])


def _moment_like(n: int, signed: bool, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed data spanning many decades, like Adam moments (v ~ g^2 is log-normal-ish)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 2)
    return x if signed else x * x


def _first_mismatches(a: torch.Tensor, b: torch.Tensor, k: int = 5) -> str:
    idx = (a != b).nonzero().flatten()[:k].tolist()
    return ", ".join(f"[{i}] {a[i].item()} vs {b[i].item()}" for i in idx)


# ---------------------------------------------------------------------------------------------------------------
# quantisation
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_equals_bitsandbytes(signed):
    bnbf = pytest.importorskip("bitsandbytes.functional")
    assert torch.equal(create_dynamic_map(signed=signed), bnbf.create_dynamic_map(signed=signed))


@pytest.mark.parametrize("signed", [True, False])
def test_lookup_gives_nearest_code(signed):
    """Bucket table + one comparison == bucketize over the fp32 midpoints == nearest code, except that the unsigned
    map gives every positive value a non-zero code (Note: [A non-zero second moment keeps a non-zero code]).

    Nearest up to the rounding of the fp32 midpoints themselves: where a value sits within an ulp of a midpoint the
    two neighbouring codes are equally near to float precision.
    """
    lk = dynamic_lookup(signed)
    assert lk.keep_nonzero == (not signed)
    cmap = torch.from_numpy(lk.code_map.copy())
    mids = lk.mids_t
    nearest_mids = (cmap[:-1] + cmap[1:]) / 2  # bitsandbytes' midpoints
    lo = -1.0 if signed else 0.0
    x = torch.cat(
        [
            torch.rand(200_000, generator=torch.Generator().manual_seed(1)) * (1 - lo) + lo,
            _moment_like(100_000, signed).clamp(lo, 1.0),
            nearest_mids,  # exact ties
            torch.nextafter(nearest_mids, torch.full_like(nearest_mids, 2.0)),
            torch.nextafter(nearest_mids, torch.full_like(nearest_mids, -2.0)),
            cmap,
            torch.tensor([0.0, -0.0, 1e-45, 1e-40, 1e-20, 1e-9, 1.6e-7]),  # zero, denormals, below code_map[1] / 2
        ]
    ).clamp(lo, 1.0)
    bits = x.view(torch.int32).numpy().view("uint32") >> 15
    base = torch.from_numpy(lk.lut[bits].astype("int64"))
    codes = base + (x > torch.from_numpy(lk.bucket_mid[bits])).long()
    reference = torch.bucketize(x, mids)
    assert torch.equal(codes, reference), _first_mismatches(codes, reference)
    dist = (x[:, None].double() - cmap[None, :].double()).abs()
    chosen = dist.gather(1, codes[:, None]).squeeze(1)
    ulp = torch.finfo(torch.float32).eps * x.abs().double().clamp(min=1e-30)
    rounded_up = (x > 0) & (x <= nearest_mids[0]) if not signed else torch.zeros_like(x, dtype=torch.bool)
    assert (chosen <= dist.min(dim=1).values + ulp)[~rounded_up].all()
    if not signed:
        assert rounded_up.sum() >= 5 and codes[rounded_up].eq(1).all()  # the smallest non-zero code, not 0
        assert codes[x == 0].eq(0).all()
        # Nearest everywhere else: the same codes as bitsandbytes' midpoints.
        assert torch.equal(codes[~rounded_up], torch.bucketize(x, nearest_mids)[~rounded_up])


def test_keep_nonzero_needs_an_unsigned_map():
    from lazytrain_hf.optim.quant import CodeLookup

    with pytest.raises(ValueError, match="keep_nonzero"):
        CodeLookup.from_map(create_dynamic_map(signed=True), keep_nonzero=True)
    plain = CodeLookup.from_map(create_dynamic_map(signed=False))
    assert not plain.keep_nonzero and plain.mids_t[0] > 0  # nearest rounding (bitsandbytes' midpoints)


@pytest.mark.parametrize("signed", [True, False])
def test_quantization_error_no_worse_than_bitsandbytes(signed):
    bnbf = pytest.importorskip("bitsandbytes.functional")
    x = _moment_like(256 * 400 + 77, signed, seed=3)  # a partial last block too
    ours = Quantized8bit.from_tensor(x, block_size=256, signed=signed).dequantize()
    qb, state = bnbf.quantize_blockwise(x, code=bnbf.create_dynamic_map(signed=signed), blocksize=256)
    theirs = bnbf.dequantize_blockwise(qb, state)
    err_ours, err_bnb = (ours - x).abs(), (theirs - x).abs()
    # Nearest-code rounding: per element never worse than bitsandbytes (up to float rounding of the product).
    assert (err_ours <= err_bnb + 1e-6 * x.abs()).all()
    assert err_ours.mean() <= err_bnb.mean() * (1 + 1e-6)
    assert err_ours.max() <= err_bnb.max() * (1 + 1e-6)


def test_quantized8bit_zeros_dequantize_and_repr():
    q = Quantized8bit.zeros(1000, block_size=256, signed=True)
    assert q.codes.dtype == torch.uint8 and q.absmax.dtype == torch.float32 and q.absmax.numel() == 4
    assert torch.equal(q.dequantize(), torch.zeros(1000))
    assert q.nbytes() == 1000 + 4 * 4
    assert "numel=1000" in repr(q) and "signed" in repr(q)
    x = _moment_like(1000, True)
    q.quantize_(x)
    back = q.dequantize()
    # Each value lands on the nearest code: error at most half the widest gap of the map (or the distance from -1
    # to the lowest code: the signed map has +1 but not -1), times the block absmax.
    gap = max(torch.diff(q.code_map).max().item() / 2, 1 + q.code_map.min().item()) * (1 + 1e-6)
    scale = q.absmax.repeat_interleave(256)[:1000]
    assert ((back - x).abs() <= gap * scale + 1e-6 * x.abs()).all()  # + float rounding of the product
    with pytest.raises(ValueError, match="absmax"):
        Quantized8bit(torch.zeros(10, dtype=torch.uint8), torch.zeros(3), 256, True)


# ---------------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not NUMBA_AVAILABLE, reason="numba not installed")
def test_numba_and_torch_backends_agree():
    n = 3 * 256 * 512 + 100
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    results = {}
    for backend in ("numba", "torch"):
        p = p0.clone()
        m, v = Quantized8bit.zeros(n, 256, True), Quantized8bit.zeros(n, 256, False)
        out = torch.empty(n, dtype=torch.bfloat16)
        g_gen = torch.Generator().manual_seed(1)
        for step in range(1, 6):
            g = torch.randn(n, generator=g_gen) * 1e-2
            adamw8bit_step(p, g, m, v, AdamWScalars.make(1e-3, 0.9, 0.999, 1e-8, 0.1, step, 0.7), out, backend)
            # The bf16 copy written in the pass is exactly the rounded master.
            assert torch.equal(out, p.to(torch.bfloat16)), backend
        results[backend] = (p, m, v)
    (pn, mn, vn), (pt, mt, vt) = results["numba"], results["torch"]
    for a, b in ((mn, mt), (vn, vt)):
        diff = (a.codes.int() - b.codes.int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
        assert torch.allclose(a.absmax, b.absmax, rtol=1e-5, atol=0)
    assert torch.allclose(pn, pt, rtol=0, atol=1e-4)
    assert (pn != pt).float().mean() < 0.02  # ulp-level differences on ~0.6% of elements


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_state_path_is_bit_identical_to_torch_adamw(backend):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(40, 30))  # 1200 < min_8bit_size: fp32 moments
    b = torch.nn.Parameter(a.detach().clone())
    ours = HybridAdamW8bit([a], lr=1e-2, weight_decay=0.05, backend=backend)
    ref = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.05, foreach=False)
    for _ in range(20):
        g = torch.randn(40, 30)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        assert torch.equal(a, b), _first_mismatches(a.flatten(), b.flatten())


def _quadratic_problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(256, 64, generator=gen)
    x = torch.randn(512, 256, generator=gen)
    y = x @ w_true + 0.1 * torch.randn(512, 64, generator=gen)
    w0 = torch.randn(256, 64, generator=gen) * 0.1
    return x, y, w0


@pytest.mark.parametrize("backend", BACKENDS)
def test_trajectory_close_to_adamw_on_random_problem(backend):
    """Least squares, 100 steps: at every step |w_ours - w_ref| <= 8% of |w_ref - w0| (after the first 5)."""
    x, y, w0 = _quadratic_problem()
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ours = HybridAdamW8bit([a], lr=1e-2, weight_decay=0.01, backend=backend)
    ref = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.01)
    losses_a, losses_b = [], []
    for step in range(100):
        for p, opt, losses in ((a, ours, losses_a), (b, ref, losses_b)):
            opt.zero_grad()
            loss = ((x @ p - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if step >= 5:
            rel = (a - b).norm() / (b - w0).norm()
            assert rel < 0.08, f"step {step}: relative deviation {rel:.4f}"
    assert losses_a[-1] < 0.25 * losses_a[0]  # it trains
    rel_loss = max(abs(la - lb) / lb for la, lb in zip(losses_a, losses_b))
    assert rel_loss < 0.03, rel_loss


def _tiny_qwen3():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    return transformers, cfg, {k: v.clone() for k, v in model.state_dict().items()}


def _qwen_losses(make_opt, steps: int) -> list[float]:
    transformers, cfg, sd = _tiny_qwen3()
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    model.load_state_dict(sd)
    model.train()
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    opt = make_opt([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}])
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _check_qwen(steps: int, tol: float) -> None:
    ref = _qwen_losses(lambda groups: torch.optim.AdamW(groups, lr=3e-3), steps)
    ours = _qwen_losses(lambda groups: HybridAdamW8bit(groups, lr=3e-3), steps)
    assert ours[-1] < 0.2 * ours[0]
    worst = max(abs(a - b) / b for a, b in zip(ours, ref))
    assert worst < tol, f"largest relative loss gap {worst:.4f}; ours {ours[::10]}, AdamW {ref[::10]}"


def test_tiny_qwen3_loss_curve_short():
    """30 steps, every loss within 2% of AdamW's (measured < 0.5%)."""
    _check_qwen(30, 0.02)


@pytest.mark.slow
def test_tiny_qwen3_loss_curve_200_steps():
    """200 steps on a fixed batch, every loss within 6% of AdamW's (measured < 3%, once the loss is ~0.02)."""
    _check_qwen(200, 0.06)


# ---------------------------------------------------------------------------------------------------------------
# clipping inside the pass
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_clip_equals_clip_then_step(backend):
    """clip_coef inside the pass is bit-identical to scaling the gradients first, and tracks clip_grad_norm_ + AdamW."""
    from lazytrain_hf.optim import clip_coefficient, global_norm, partial_sq_norms

    x, y, w0 = _quadratic_problem(1)
    a, b, c = (torch.nn.Parameter(w0.clone()) for _ in range(3))
    fused = HybridAdamW8bit([a], lr=1e-2, backend=backend)
    prescaled = HybridAdamW8bit([b], lr=1e-2, backend=backend)
    ref = torch.optim.AdamW([c], lr=1e-2)
    for step in range(30):
        for p in (a, b, c):
            p.grad = None
            ((x @ p - y) ** 2).mean().backward()
        coef = clip_coefficient(global_norm(partial_sq_norms([a.grad])), max_norm=0.5)
        assert coef < 1.0  # the clip is active
        fused.step(clip_coef=coef)
        b.grad.mul_(torch.tensor(coef, dtype=torch.float32))
        prescaled.step()
        torch.nn.utils.clip_grad_norm_([c], 0.5)
        ref.step()
        assert torch.equal(a, b), f"step {step}: {_first_mismatches(a.flatten(), b.flatten())}"
        if step >= 5:
            assert (a - c).norm() / (c - w0).norm() < 0.08


# ---------------------------------------------------------------------------------------------------------------
# per-layer entry points, flat buffers, groups, schedulers
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_group_on_flat_layer_buffers_writes_bf16(backend):
    """Flat fp32 master per layer (grad = flat grad buffer) + flat bf16 compute buffer, updated layer by layer."""
    gen = torch.Generator().manual_seed(0)
    layers = [torch.randn(5000 + 300 * i, generator=gen) for i in range(3)]
    twins = [t.clone() for t in layers]
    for t, u in zip(layers, twins):
        t.grad = torch.randn(t.numel(), generator=gen)
        u.grad = t.grad.clone()
    opt = HybridAdamW8bit([{"params": [t]} for t in layers], lr=1e-3, backend=backend)
    whole = HybridAdamW8bit([{"params": [t]} for t in twins], lr=1e-3, backend=backend)
    compute = [torch.zeros(t.numel(), dtype=torch.bfloat16) for t in layers]
    before = [t.clone() for t in layers]
    opt.step_group(0, clip_coef=0.5, out_bf16=compute[0])
    assert torch.equal(layers[1], before[1]) and torch.equal(layers[2], before[2])  # only group 0 moved
    assert not torch.equal(layers[0], before[0])
    for i in (1, 2):
        opt.step_group(i, clip_coef=0.5, out_bf16=compute[i])
    whole.step(clip_coef=0.5)
    for t, u, out in zip(layers, twins, compute):
        assert torch.equal(t, u)  # per-layer order gives the same result as one full step
        assert torch.equal(out, t.to(torch.bfloat16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_params_and_per_parameter_outputs(backend):
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
    twin = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
    twin.load_state_dict(model.state_dict())
    for m in (model, twin):
        m(torch.randn(16, 64, generator=torch.Generator().manual_seed(2))).square().sum().backward()
    opt = HybridAdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=1024, backend=backend)
    ref = HybridAdamW8bit(twin.parameters(), lr=1e-3, min_8bit_size=1024, backend=backend)
    params = list(model.parameters())
    outs = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params[2:]]
    opt.step_params(params[2:], out_bf16=outs)  # second layer first, as a backward-ordered runtime would
    opt.step_params(params[:2])
    ref.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    for p, out in zip(params[2:], outs):
        assert torch.equal(out, p.to(torch.bfloat16))
    with pytest.raises(ValueError, match="not managed"):
        opt.step_params([torch.zeros(3)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_params_writes_compute_views_of_a_flat_bf16_buffer(backend):
    """``out_bf16`` as the trainer passes it: per parameter, a view (of the parameter's shape) into one flat bf16
    compute buffer of the layer, for 8-bit and fp32-state parameters alike, ``None`` where no copy is wanted. The
    views receive exactly ``p.to(bfloat16)`` in the same pass; the parameters and states equal a step without them."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(96, 64), (64,), (40, 130), (8,)]  # 8-bit, fp32-state, 8-bit with a partial block, fp32-state
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = HybridAdamW8bit(params, lr=1e-2, weight_decay=0.1, backend=backend)
    ref = HybridAdamW8bit(twins, lr=1e-2, weight_decay=0.1, backend=backend)
    flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.bfloat16)
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    untouched = views[3].clone()
    for step in range(3):
        for p, q in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step_params(params, clip_coef=0.5, out_bf16=[views[0], views[1], views[2], None])
        ref.step(clip_coef=0.5)
        for i, (p, q) in enumerate(zip(params, twins)):
            assert torch.equal(p, q), f"step {step}, param {i}: {_first_mismatches(p.flatten(), q.flatten())}"
        for i in range(3):
            assert torch.equal(views[i], params[i].detach().to(torch.bfloat16)), f"step {step}, param {i}"
        assert torch.equal(views[3], untouched)
    assert isinstance(opt.state[params[0]]["exp_avg"], Quantized8bit)
    assert isinstance(opt.state[params[1]]["exp_avg"], torch.Tensor)
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        opt.step_params(params[:1], out_bf16=[torch.zeros(64, 96, dtype=torch.bfloat16).t()])


@pytest.mark.parametrize("backend", BACKENDS)
def test_lr_scheduler_and_no_decay_group(backend):
    torch.manual_seed(0)
    big, small = torch.nn.Parameter(torch.randn(8192)), torch.nn.Parameter(torch.randn(64))
    big2, small2 = torch.nn.Parameter(big.detach().clone()), torch.nn.Parameter(small.detach().clone())
    big0 = big.detach().clone()

    def groups(b, s):
        return [{"params": [b], "weight_decay": 0.1}, {"params": [s], "weight_decay": 0.0}]

    ours = HybridAdamW8bit(groups(big, small), lr=1e-2, backend=backend)
    ref = torch.optim.AdamW(groups(big2, small2), lr=1e-2, foreach=False)
    sched = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (ours, ref)]
    for _ in range(10):
        g, gs = torch.randn(8192), torch.randn(64)
        big.grad, small.grad, big2.grad, small2.grad = g.clone(), gs.clone(), g.clone(), gs.clone()
        ours.step()
        ref.step()
        for s in sched:
            s.step()
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == pytest.approx(1e-2 / 11)
    assert torch.equal(small, small2)  # fp32 group: exact under the schedule and without decay
    assert (big - big2).norm() / (big2 - big0).norm() < 0.08
    # Weight decay really is per group: with no gradient signal only the decayed group shrinks.
    p_d, p_n = torch.nn.Parameter(torch.ones(8192)), torch.nn.Parameter(torch.ones(8192))
    opt = HybridAdamW8bit(
        [{"params": [p_d], "weight_decay": 0.5}, {"params": [p_n], "weight_decay": 0.0}], lr=0.1, backend=backend
    )
    p_d.grad, p_n.grad = torch.zeros(8192), torch.zeros(8192)
    opt.step()
    assert torch.allclose(p_d, torch.full((8192,), 1 - 0.1 * 0.5)) and torch.equal(p_n, torch.ones(8192))


# ---------------------------------------------------------------------------------------------------------------
# state dicts and memory
# ---------------------------------------------------------------------------------------------------------------


def _trained_opt(backend, block_size=256):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(100, 100)), torch.nn.Parameter(torch.randn(50))]
    opt = HybridAdamW8bit(params, lr=1e-2, weight_decay=0.01, block_size=block_size, backend=backend)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params, opt


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_round_trip_is_exact(backend):
    params, opt = _trained_opt(backend)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = HybridAdamW8bit(twins, lr=1.0, backend=backend)  # hyperparameters come from the state dict
    opt2.load_state_dict(loaded)
    s1, s2 = opt.state[params[0]], opt2.state[twins[0]]
    assert s1["step"] == s2["step"] == 3
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(s1[key].codes, s2[key].codes) and torch.equal(s1[key].absmax, s2[key].absmax)
        assert s1[key].codes.data_ptr() != s2[key].codes.data_ptr()  # a copy, not the saved tensors
        assert torch.equal(opt.state[params[1]][key], opt2.state[twins[1]][key])
    assert opt2.param_groups[0]["lr"] == 1e-2
    for _ in range(3):  # resumed training continues bit for bit
        for p, q in zip(params, twins):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        opt2.step()
    for p, q in zip(params, twins):
        assert torch.equal(p, q)


def test_state_dict_format_version():
    """state_dict() names its layout; a format-1 dict (before the non-zero rule for v) is converted with a warning
    (a positive v stored as code 0 where m is non-zero takes code 1); an unknown newer format is refused."""
    from lazytrain_hf.optim.hybrid8bit import FORMAT_KEY, STATE_FORMAT

    params, opt = _trained_opt("torch")
    sd = opt.state_dict()
    assert sd[FORMAT_KEY] == STATE_FORMAT == 2
    old = {k: v for k, v in sd.items() if k != FORMAT_KEY}
    old["state"] = {k: dict(e) for k, e in sd["state"].items()}
    codes = old["state"][0]["exp_avg_sq_codes"].clone()
    m_codes = old["state"][0]["exp_avg_codes"]
    lost = torch.zeros_like(codes, dtype=torch.bool)
    lost[:50] = True  # what the old rule stored for tiny positive values
    codes[lost] = 0
    old["state"][0]["exp_avg_sq_codes"] = codes
    assert (m_codes[lost] != dynamic_lookup(True).zero_code).all()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = HybridAdamW8bit(twins, backend="torch")
    with pytest.warns(UserWarning, match="format-1 HybridAdamW8bit state: 50 elements"):
        opt2.load_state_dict(old)
    v = opt2.state[twins[0]]["exp_avg_sq"].codes
    assert v[lost].eq(1).all() and torch.equal(v[~lost], sd["state"][0]["exp_avg_sq_codes"][~lost])
    with pytest.raises(ValueError, match="newer lazytrain_hf"):
        HybridAdamW8bit(twins, backend="torch").load_state_dict(dict(sd, **{FORMAT_KEY: STATE_FORMAT + 1}))


def test_load_state_dict_with_wrong_shapes_names_the_parameter():
    params, opt = _trained_opt("torch")
    sd = opt.state_dict()
    other = [torch.nn.Parameter(torch.randn(100, 99)), torch.nn.Parameter(torch.randn(50))]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*\(100, 99\)"):
        HybridAdamW8bit(other, backend="torch").load_state_dict(sd)
    bad = opt.state_dict()
    bad["state"][0] = dict(bad["state"][0], exp_avg_absmax=torch.zeros(7))
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    with pytest.raises(ValueError, match="exp_avg.*blocks of 256"):
        HybridAdamW8bit(twins, backend="torch").load_state_dict(bad)
    named = HybridAdamW8bit([("layer.weight", twins[0]), ("layer.bias", twins[1])], backend="torch")
    small = opt.state_dict()
    small["state"][1] = dict(small["state"][1], exp_avg=torch.zeros(49))
    with pytest.raises(ValueError, match="'layer.bias'"):
        named.load_state_dict(small)
    with pytest.raises(ValueError, match="parameter groups"):
        HybridAdamW8bit([{"params": [twins[0]]}, {"params": [twins[1]]}], backend="torch").load_state_dict(sd)


def test_state_bytes_per_param():
    big = torch.nn.Parameter(torch.randn(1 << 16))
    opt = HybridAdamW8bit([big], block_size=256, backend="torch")
    assert opt.state_bytes_per_param() == pytest.approx(2 + 8 / 256)
    big.grad = torch.randn_like(big)
    opt.step()
    st = opt.state[big]
    assert opt.state_bytes() == st["exp_avg"].nbytes() + st["exp_avg_sq"].nbytes()
    mixed = HybridAdamW8bit([big, torch.nn.Parameter(torch.randn(100))], backend="torch")
    assert mixed.state_bytes() == 2 * ((1 << 16) + 4 * 256) + 8 * 100
    assert HybridAdamW8bit([big], block_size=64, backend="torch").state_bytes_per_param() == pytest.approx(2 + 8 / 64)


# ---------------------------------------------------------------------------------------------------------------
# user errors, backends, odd layouts
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "lr=-1.0"),
        ({"betas": (0.9, 1.0)}, "betas="),
        ({"eps": 0.0}, "eps=0.0"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1"),
        ({"block_size": 8}, "block_size=8"),
        ({"block_size": 8192}, "block_size=8192"),
        ({"min_8bit_size": 0}, "min_8bit_size=0"),
        ({"backend": "cuda"}, "backend='cuda'"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HybridAdamW8bit([torch.nn.Parameter(torch.zeros(4))], **kwargs)


def test_bad_parameters_and_step_arguments_raise():
    with pytest.raises(TypeError, match="float32 CPU master"):
        HybridAdamW8bit([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))])
    p = torch.nn.Parameter(torch.zeros(5000))
    opt = HybridAdamW8bit([p], backend="torch")
    p.grad = torch.zeros(5000)
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match="clip_coef"):
            opt.step(clip_coef=bad)
    with pytest.raises(ValueError, match="out_bf16"):
        opt.step_group(0, out_bf16=torch.zeros(5000))
    with pytest.raises(ValueError, match="out_bf16"):
        opt.step_group(0, out_bf16=torch.zeros(10, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="group_index=3"):
        opt.step_group(3)
    assert not opt.state.get(p)  # the rejected calls left no state behind


def test_backend_selection_and_repr(monkeypatch):
    monkeypatch.setenv("LAZYTRAIN_OPTIM_BACKEND", "torch")
    opt = HybridAdamW8bit([torch.nn.Parameter(torch.zeros(4))])
    assert opt.backend == "torch" and "backend: torch" in repr(opt)
    monkeypatch.setenv("LAZYTRAIN_OPTIM_BACKEND", "fortran")
    with pytest.raises(ValueError, match="LAZYTRAIN_OPTIM_BACKEND='fortran'"):
        resolve_backend(None)
    monkeypatch.delenv("LAZYTRAIN_OPTIM_BACKEND")
    from lazytrain_hf.optim import native

    fast_native = native.available() and native.isa() == "avx512"
    assert resolve_backend(None) == ("native" if fast_native else "numba" if NUMBA_AVAILABLE else "torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_parameter(backend):
    base = torch.randn(128, 64)
    a = base.t()  # non-contiguous view
    b = a.contiguous()
    a.grad = torch.randn(64, 128)
    b.grad = a.grad.clone()
    HybridAdamW8bit([a], lr=1e-2, backend=backend).step()
    HybridAdamW8bit([b], lr=1e-2, backend=backend).step()
    assert torch.equal(a, b) and torch.equal(base.t(), b)
