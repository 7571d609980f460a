"""Fast gradient clipping: the global norm from per-layer partial squared norms, no extra pass to scale.

``torch.nn.utils.clip_grad_norm_`` reads every gradient once for the norm and again (read + write) to scale it.
Here the squared norm of each layer's gradients is taken where they are produced (on the device, in the backward
hook, before the copy to the host) or, used alone, in one read of host tensors; the global norm is
``sqrt(sum of partials)`` and the coefficient ``min(1, max_norm / (norm + 1e-6))`` is handed to
`HybridAdamW8bit.step(clip_coef=...)`, which applies it inside its fused pass. A non-finite norm means the
step must be skipped (`norm_is_finite`), as Trainer does with ``max_grad_norm``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable

import torch

# As torch.nn.utils.clip_grad_norm_: keeps the coefficient finite for an all-zero gradient.
CLIP_EPS = 1e-6


def _present(tensors: Iterable[torch.Tensor | None]) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    return [t.detach() for t in tensors if t is not None]


def sq_norm(tensors: Iterable[torch.Tensor | None] | torch.Tensor) -> torch.Tensor:
    """Sum of squares of ``tensors`` (``None`` skipped) as a 0-dim float64 tensor on their device; no host sync.

    Each tensor's 2-norm is taken in float32 (as ``clip_grad_norm_`` does) and squared and summed in float64.
    All tensors must be on one device.
    """
    ts = _present(tensors)
    if not ts:
        return torch.zeros((), dtype=torch.float64)
    devices = {t.device for t in ts}
    if len(devices) > 1:
        raise ValueError(f"sq_norm got tensors on {sorted(map(str, devices))}; call it once per device.")
    norms = torch._foreach_norm(ts) if len(ts) > 1 else [torch.linalg.vector_norm(ts[0])]
    stacked = torch.stack([n.to(torch.float64) for n in norms])
    return (stacked * stacked).sum()


def partial_sq_norms(tensors: Iterable[torch.Tensor | None]) -> list[float]:
    """Per-tensor squared 2-norms of host tensors (``None`` skipped), one read of each, as Python floats."""
    ts = _present(tensors)
    if not ts:
        return []
    norms = torch._foreach_norm(ts) if len(ts) > 1 else [torch.linalg.vector_norm(ts[0])]
    return [float(n.double()) ** 2 for n in norms]


def global_norm(partials: Iterable[float | torch.Tensor]) -> float:
    """Global 2-norm from partial squared norms (floats or 0-dim tensors on any devices), with one sync per device.

    Returns ``inf`` or ``nan`` when a partial is not finite; check with `norm_is_finite` before stepping.
    """
    total = 0.0
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for part in partials:
        if isinstance(part, torch.Tensor):
            by_device.setdefault(part.device, []).append(part.detach().reshape(()).to(torch.float64))
        else:
            total += float(part)
    for parts in by_device.values():
        total += float(torch.stack(parts).sum())
    return math.sqrt(total)


def norm_is_finite(norm: float | torch.Tensor) -> bool:
    """Whether the step may proceed: ``False`` for an inf/nan norm (the caller skips the step)."""
    return math.isfinite(float(norm))


def clip_coefficient(norm: float | torch.Tensor, max_norm: float) -> float:
    """``min(1, max_norm / (norm + 1e-6))``, the scale ``clip_grad_norm_`` applies, as a float.

    Raises:
        ValueError: when ``max_norm`` is not a positive finite number, or ``norm`` is not finite (skip the step).
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not 0 < max_norm < math.inf:
        raise ValueError(
            f"max_norm={max_norm!r} must be a positive finite float (e.g. 1.0); to disable clipping "
            f"pass clip_coef=None to the optimizer."
        )
    norm = float(norm)
    if not math.isfinite(norm):
        raise ValueError(f"norm={norm} is not finite; check norm_is_finite(norm) and skip the step.")
    return min(1.0, max_norm / (norm + CLIP_EPS))


class GradNormAccumulator:
    """Accumulates squared gradient norms where the gradients are produced, without host synchronisation.

    Call `add` from a backward hook (e.g. ``register_post_accumulate_grad_hook``) with a layer's gradients while they
    are still on the device; the squared norm is added to a per-device float64 accumulator and recorded per
    ``key`` (e.g. the layer index). `global_norm` synchronises once per device at the end of backward.

    Example:

    ```python
    >>> acc = GradNormAccumulator()
    >>> for i, layer in enumerate(layers):
    ...     layer.weight.register_post_accumulate_grad_hook(lambda p, i=i: acc.add([p.grad], key=i))
    >>> loss.backward()
    >>> norm = acc.global_norm(); acc.reset()
    ```
    """

    def __init__(self) -> None:
        self._partials: dict[Hashable, torch.Tensor] = {}

    def add(self, tensors: Iterable[torch.Tensor | None] | torch.Tensor, key: Hashable | None = None) -> None:
        """Add the squared norm of ``tensors`` to ``key``'s partial (keys accumulate; default key ``None``)."""
        part = sq_norm(tensors)
        if key in self._partials:
            prev = self._partials[key]
            self._partials[key] = prev + part.to(prev.device)
        else:
            self._partials[key] = part

    @property
    def partials(self) -> dict[Hashable, torch.Tensor]:
        """Per-key squared norms (0-dim float64 tensors on the gradients' devices)."""
        return dict(self._partials)

    def global_norm(self) -> float:
        """``sqrt`` of the sum of all partials (inf/nan if any gradient was)."""
        return global_norm(self._partials.values())

    def reset(self) -> None:
        self._partials.clear()

    def __len__(self) -> int:
        return len(self._partials)

    def __repr__(self) -> str:
        devices = sorted({str(t.device) for t in self._partials.values()})
        return f"GradNormAccumulator(keys={len(self._partials)}, devices={devices})"
