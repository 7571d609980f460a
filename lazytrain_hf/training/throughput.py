"""The throughput `LazyTrainer.log()` reports for the steps since the last log: tokens/s, TFLOPS and step time.

Owns `ThroughputWindow` (the tokens counted since the last log and when counting started) and `throughput_logs`, a
pure function of those counts, the model's parameter count and the plan's predicted step time.
"""

from __future__ import annotations

import time
from typing import Any


def throughput_logs(tokens: int, secs: float, steps: int, n_params: int, plan=None) -> dict[str, float]:
    """``tokens_per_s``, ``tflops``, ``step_time_s`` of ``tokens`` trained in ``secs`` over ``steps`` optimizer steps
    by a model of ``n_params`` parameters, and ``predicted_step_time_s`` where ``plan`` (a `Plan` or None) predicts
    one."""
    out: dict[str, float] = {}
    out["tokens_per_s"] = tokens / secs
    # 6 * N * tokens (forward + backward), as `Trainer.floating_point_ops`; recompute not counted as useful
    out["tflops"] = 6 * n_params * tokens / secs / 1e12
    out["step_time_s"] = secs / steps
    predicted = (plan.predicted or {}).get("step_time_s") if plan else None
    if predicted:
        out["predicted_step_time_s"] = float(predicted)
    return out


class ThroughputWindow:
    """The tokens trained since the last log (``tokens``: device tensors summed, so no host sync per micro-batch),
    the time the first of them was counted (``t0``) and the optimizer step of the last log (``last_step``)."""

    def __init__(self) -> None:
        self.t0: float | None = None
        self.tokens: Any = 0
        self.last_step = 0

    def count(self, tokens: Any) -> None:
        """Add the tokens of a micro-batch (an int or a device tensor; read once per log in `logs`)."""
        if self.t0 is None:
            self.t0 = time.perf_counter()
        self.tokens += tokens

    def logs(self, global_step: int, n_params, plan=None) -> dict[str, float]:
        """`throughput_logs` of the window (nothing before a token was counted; ``n_params()`` gives the model's
        parameter count), and a new window from now."""
        out: dict[str, float] = {}
        now = time.perf_counter()
        tokens = int(self.tokens)
        if self.t0 is not None and tokens:
            steps = max(1, global_step - self.last_step)
            out.update(throughput_logs(tokens, now - self.t0, steps, n_params(), plan))
        self.tokens, self.last_step, self.t0 = 0, global_step, now
        return out

    def __repr__(self) -> str:
        return f"ThroughputWindow(t0={self.t0}, last_step={self.last_step})"
