"""Fast clipping: global norm from partial squared norms vs torch.nn.utils.clip_grad_norm_ (1e-6 relative)."""

from __future__ import annotations

import math

import pytest
import torch

from lazytrain_hf.optim import (
    GradNormAccumulator,
    clip_coefficient,
    global_norm,
    norm_is_finite,
    partial_sq_norms,
    sq_norm,
)


def _grads(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(300, 200), (200,), (4096,), (17, 33, 5), (1,)]
    return [torch.randn(s, generator=gen) * 10 ** torch.randint(-3, 3, (1,), generator=gen).item() for s in shapes]


def _torch_norm(grads: list[torch.Tensor]) -> float:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm=1e9))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_global_norm_matches_clip_grad_norm(seed):
    grads = _grads(seed)
    ref = _torch_norm(grads)
    ours = global_norm(partial_sq_norms(grads))
    assert abs(ours - ref) <= 1e-6 * ref
    # Per-layer partials (two "layers") add up to the same norm, from floats or from device tensors.
    layer_a, layer_b = grads[:2], grads[2:]
    assert abs(global_norm([sq_norm(layer_a), sq_norm(layer_b)]) - ref) <= 1e-6 * ref
    assert abs(global_norm([sum(partial_sq_norms(layer_a)), sq_norm(layer_b)]) - ref) <= 1e-6 * ref


def test_accumulator_from_backward_hooks_matches_clip_grad_norm():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    acc = GradNormAccumulator()
    for i, layer in enumerate(m for m in model if isinstance(m, torch.nn.Linear)):
        for p in layer.parameters():
            p.register_post_accumulate_grad_hook(lambda p, i=i: acc.add([p.grad], key=i))
    model(torch.randn(16, 32)).square().sum().backward()
    assert set(acc.partials) == {0, 1} and len(acc) == 2
    ours = acc.global_norm()
    ref = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9))
    assert abs(ours - ref) <= 1e-6 * ref
    assert "keys=2" in repr(acc)
    acc.reset()
    assert acc.global_norm() == 0.0


def test_clip_coefficient_formula_and_errors():
    assert clip_coefficient(10.0, 1.0) == pytest.approx(1.0 / (10.0 + 1e-6), rel=1e-12)
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(0.0, 1.0) == 1.0
    # Same coefficient clip_grad_norm_ applies (it scales by max_norm / (norm + 1e-6), clamped to 1).
    grads = _grads(3)
    norm = global_norm(partial_sq_norms(grads))
    coef = clip_coefficient(norm, 0.25)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 0.25)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g * coef, rtol=1e-6, atol=0)
    for bad in (0.0, -1.0, math.inf, True):
        with pytest.raises(ValueError, match="max_norm="):
            clip_coefficient(1.0, bad)
    with pytest.raises(ValueError, match="norm_is_finite"):
        clip_coefficient(math.nan, 1.0)


def test_non_finite_gradients_are_detected():
    grads = _grads(0)
    assert norm_is_finite(global_norm(partial_sq_norms(grads)))
    grads[1][3] = math.inf
    assert not norm_is_finite(global_norm(partial_sq_norms(grads)))
    grads[1][3] = math.nan
    assert not norm_is_finite(global_norm(partial_sq_norms(grads)))
    acc = GradNormAccumulator()
    acc.add(grads[:2], key="layer0")
    acc.add(grads[2:], key="layer1")
    assert not norm_is_finite(acc.global_norm())


def test_none_gradients_are_skipped_and_devices_are_checked():
    g = torch.ones(4)
    assert partial_sq_norms([None, g, None]) == [4.0]
    assert global_norm([]) == 0.0
    assert float(sq_norm([None])) == 0.0
    if torch.cuda.is_available():  # pragma: no cover - exercised on GPU machines
        with pytest.raises(ValueError, match="once per device"):
            sq_norm([g, g.cuda()])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_partials_match_host():
    grads = _grads(4)
    acc = GradNormAccumulator()
    for i, g in enumerate(grads):
        acc.add([g.cuda()], key=i)
    assert all(t.device.type == "cuda" for t in acc.partials.values())
    ref = _torch_norm(grads)
    assert abs(acc.global_norm() - ref) <= 1e-6 * ref
