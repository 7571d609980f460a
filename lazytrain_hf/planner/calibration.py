"""Calibration of the cost model against published runs: the points, their predictions and the residuals.

The points live in ``calibration.json`` beside this module, each with its source (paper or repository, file, what
was measured) and its conditions (model, hardware, batch, sequence length, TFLOPS convention). A point is predicted
the way its executor runs:

- ``lazytrain``: the MILP plan of `milp.plan_for_model` at the point's fixed batch, evaluated by the stage model;
- ``megatrain``: the ``megatrain`` baseline plan of `baselines.make_baseline` (MegaTrain's own executor model).

Both published conventions count ``6 * N * tokens / step_time`` (``N`` incl. embeddings and lm_head, padded tokens,
no attention or recompute FLOPs), so the predicted TFLOPS of a point is `tflops_6n` of the predicted step time.

    >>> from lazytrain_hf.planner.calibration import residuals
    >>> for r in residuals():
    ...     print(r["point"], r["quantity"], r["measured"], r["predicted"], f"{r['rel_error']:+.1%}")

Imports neither torch nor transformers (the zoo configs and the planner only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any

from .costmodel import CostModel
from .hardware import HardwareProfile, get_profile
from .zoo import get_config

CALIBRATION_FILE = os.path.join(os.path.dirname(__file__), "calibration.json")
EXECUTORS = ("lazytrain", "megatrain")


def _load(path: str = CALIBRATION_FILE) -> list[dict[str, Any]]:
    with open(path) as f:
        data = json.load(f)
    points = data["points"]
    for p in points:
        for key in ("name", "source", "executor", "model", "hardware", "micro_batch_size", "seq_len", "measured"):
            if key not in p:
                raise ValueError(f"calibration point {p.get('name', '?')!r} in {path} has no {key!r}.")
        if p["executor"] not in EXECUTORS:
            raise ValueError(f"calibration point {p['name']!r}: executor={p['executor']!r} is not one of {EXECUTORS}.")
    return points


CALIBRATION_POINTS: list[dict[str, Any]] = _load()


def tflops_6n(num_params: int, tokens: int, step_time_s: float) -> float:
    """TFLOPS in the ``6 * N * tokens / step_time`` convention (MegaTrain's and the LazyTrain paper's)."""
    if step_time_s <= 0:
        raise ValueError(f"step_time_s={step_time_s!r} must be > 0.")
    return 6 * num_params * tokens / step_time_s / 1e12


def get_point(name: str) -> dict[str, Any]:
    """The calibration point called ``name``."""
    for p in CALIBRATION_POINTS:
        if p["name"] == name:
            return p
    raise ValueError(f"calibration point {name!r} is not known; use one of {[p['name'] for p in CALIBRATION_POINTS]}.")


def measured_step_time(point: dict[str, Any]) -> float:
    """The step time a point's published figures imply: ``B * T / tokens_per_s`` when tokens/s is published, else
    ``6 * N * B * T / TFLOPS`` in the point's convention."""
    tokens = point["micro_batch_size"] * point["seq_len"]
    measured = point["measured"]
    if "tokens_per_s" in measured:
        return tokens / measured["tokens_per_s"]
    cm = CostModel.from_config(get_config(point["model"]), point["hardware"], point["seq_len"], 1)
    return 6 * cm.total_params * tokens / (measured["tflops"] * 1e12)


def predict_point(
    point: dict[str, Any] | str,
    hardware: HardwareProfile | str | None = None,
    *,
    time_limit: float = 30,
    solver: str = "auto",
) -> dict[str, Any]:
    """Predict one calibration point with the planner.

    Args:
        point: a point of `CALIBRATION_POINTS` or its name.
        hardware: a profile to predict with instead of the point's own (e.g. while fitting an efficiency).

    Returns:
        ``{"point", "executor", "step_time_s", "tokens_per_s", "tflops"}`` (``tflops`` in the point's own
        ``6 * N * tokens`` convention), ``"tflops_model"`` (the cost model's FLOP count: attention, no embeddings),
        ``"peak_gpu_bytes"`` and ``"plan_source"``.
    """
    p = get_point(point) if isinstance(point, str) else point
    hw = get_profile(hardware if hardware is not None else p["hardware"])
    cfg = get_config(p["model"])
    B, T = p["micro_batch_size"], p["seq_len"]
    if p["executor"] == "lazytrain":
        from .milp import plan_for_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a host-state warning for 27B on a profile's RAM is not the point here
            plan = plan_for_model(cfg, hw, T, micro_batch_size=B, time_limit=time_limit, solver=solver)
    else:
        from .baselines import make_baseline

        plan = make_baseline("megatrain", CostModel.from_config(cfg, hw, T, B, model_name=p["model"]))
    cm = CostModel.from_config(cfg, hw, T, B)
    step = float(plan.predicted["step_time_s"])
    return {
        "point": p["name"],
        "executor": p["executor"],
        "step_time_s": step,
        "tokens_per_s": B * T / step,
        "tflops": tflops_6n(cm.total_params, B * T, step),
        "tflops_model": float(plan.predicted["tflops"]),
        "peak_gpu_bytes": int(plan.predicted["peak_gpu_bytes"]),
        "plan_source": plan.source,
    }


def residuals(points: list[dict[str, Any]] | None = None, **predict_kwargs: Any) -> list[dict[str, Any]]:
    """One row per published quantity of each point: ``{"point", "quantity", "measured", "predicted", "ratio",
    "rel_error"}`` (``ratio = predicted / measured``); the implied step time is a row too."""
    rows = []
    for p in CALIBRATION_POINTS if points is None else points:
        pred = predict_point(p, **predict_kwargs)
        measured = dict(p["measured"], step_time_s=measured_step_time(p))
        for q, value in measured.items():
            got = pred[q]
            rows.append(
                {
                    "point": p["name"],
                    "quantity": q,
                    "measured": float(value),
                    "predicted": float(got),
                    "ratio": got / value,
                    "rel_error": got / value - 1,
                }
            )
    return rows


def _with_efficiency(base: HardwareProfile, compute_class: str, eta: float) -> HardwareProfile:
    if compute_class == "gemm":
        # the MoE experts' efficiency is tied to the dense one (hardware.py: a plain ratio)
        ratio = base.efficiency.get("moe", base.achievable_fraction) / base.achievable_fraction
        eff = dict(base.efficiency, moe=min(1.0, ratio * eta))
        return dataclasses.replace(base, achievable_fraction=eta, efficiency=eff)
    return dataclasses.replace(base, efficiency=dict(base.efficiency, **{compute_class: eta}))


def fit_efficiency(
    point: dict[str, Any] | str,
    compute_class: str,
    hardware: HardwareProfile | str | None = None,
    lo: float = 1e-3,
    hi: float = 1.0,
    rtol: float = 2e-3,
    **predict_kwargs: Any,
) -> float:
    """The efficiency of ``compute_class`` (``"gemm"``: ``achievable_fraction``, the MoE one following it in the
    profile's ratio) at which the point's predicted TFLOPS equals the published one: bisection in log space (the
    prediction rises with the efficiency). How the bundled Hopper constants were obtained (hardware.py)."""
    import math

    p = get_point(point) if isinstance(point, str) else point
    base = get_profile(hardware if hardware is not None else p["hardware"])
    target = p["measured"]["tflops"]

    def tflops(eta: float) -> float:
        return predict_point(p, _with_efficiency(base, compute_class, eta), **predict_kwargs)["tflops"]

    if tflops(hi) < target:
        raise ValueError(f"{p['name']}: even {compute_class} efficiency {hi} predicts less than {target} TFLOPS.")
    if tflops(lo) > target:
        raise ValueError(f"{p['name']}: even {compute_class} efficiency {lo} predicts more than {target} TFLOPS.")
    while hi / lo - 1 > rtol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if tflops(mid) < target else (lo, mid)
    return math.sqrt(lo * hi)


def fit_bundled_hopper() -> dict[str, float]:
    """Refit the two Hopper constants fitted to published runs: the dense-GEMM efficiency to MegaTrain's Qwen2.5-7B
    (a dense model: its step is GEMMs, the attention core and memory-bound passes argued from kernel measurements,
    and its serial optimizer), then, with it, the gated-delta-rule efficiency to the LazyTrain paper's Qwen3.6-27B
    (48 of its 64 layers are Gated DeltaNet)."""
    gemm = fit_efficiency("megatrain-qwen2.5-7b-h100", "gemm", lo=0.2)
    hw = _with_efficiency(get_profile("h800"), "gemm", gemm)
    linear = fit_efficiency("lazytrain-paper-qwen3.6-27b-h800", "linear_attention", hw, lo=1e-3, hi=0.5)
    return {"gemm": gemm, "linear_attention": linear}
