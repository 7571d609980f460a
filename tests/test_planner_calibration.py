"""Calibration: the published points and their sources, and the planner's predictions of them within 15%."""

from __future__ import annotations

import pytest

from lazytrain_hf.planner import calibration
from lazytrain_hf.planner.calibration import CALIBRATION_POINTS, get_point, predict_point, residuals, tflops_6n
from lazytrain_hf.planner.costmodel import CostModel
from lazytrain_hf.planner.hardware import get_profile
from lazytrain_hf.planner.zoo import get_config

TOLERANCE = 0.15


def test_points_carry_source_and_conditions():
    assert {p["name"] for p in CALIBRATION_POINTS} == {
        "lazytrain-paper-qwen3.6-27b-h800",
        "megatrain-qwen2.5-7b-h100",
    }
    for p in CALIBRATION_POINTS:
        assert {"kind", "reference", "file", "measured"} <= set(p["source"])
        assert p["tflops_convention"].startswith("6 * N")
        get_config(p["model"]), get_profile(p["hardware"])  # both resolvable
    paper = get_point("lazytrain-paper-qwen3.6-27b-h800")
    assert paper["measured"] == {"tflops": 219.95, "tokens_per_s": 1361.0, "peak_gpu_bytes": 68_840_000_000}
    assert paper["micro_batch_size"] == 72
    mega = get_point("megatrain-qwen2.5-7b-h100")
    assert (mega["micro_batch_size"], mega["seq_len"], mega["measured"]["tflops"]) == (158, 1024, 272.0)


def test_paper_sequence_length_follows_from_its_figures():
    """TFLOPS / tokens/s = 6 N + the causal attention FLOPs of the full-attention layers per token."""
    p = get_point("lazytrain-paper-qwen3.6-27b-h800")
    cfg = get_config(p["model"])
    N = CostModel.from_config(cfg, "h800", 1, 1).total_params
    per_token = p["measured"]["tflops"] * 1e12 / p["measured"]["tokens_per_s"]
    assert abs(per_token / (6 * N) - 1) < 0.002  # the paper's convention is 6N (to 0.14%)
    L_full = cfg.layer_types.count("full_attention")
    T = (per_token - 6 * N) / (6 * L_full * cfg.num_attention_heads * cfg.head_dim)
    assert round(T) == p["seq_len"] == 395


def test_implied_step_times_and_6n_convention():
    mega = get_point("megatrain-qwen2.5-7b-h100")
    N = CostModel.from_config(get_config("qwen2.5-7b"), "h100", 1024, 1).total_params
    assert calibration.measured_step_time(mega) == pytest.approx(6 * N * 158 * 1024 / 272e12)
    assert tflops_6n(N, 158 * 1024, calibration.measured_step_time(mega)) == pytest.approx(272.0)
    paper = get_point("lazytrain-paper-qwen3.6-27b-h800")
    assert calibration.measured_step_time(paper) == pytest.approx(72 * 395 / 1361)
    with pytest.raises(ValueError, match="step_time_s=0"):
        tflops_6n(N, 1, 0)


def test_h100_profile():
    h100 = get_profile("h100")
    assert h100.peak_tflops == 989.5 and h100.device_memory_bytes == 80 * 2**30 and h100.h2d_gbps == 50.0
    assert h100.device_type == "cuda" and not h100.serial_lanes and get_profile("cpu").serial_lanes


def test_points_predicted_within_tolerance():
    rows = residuals()
    table = "\n".join(
        f"{r['point']:36s} {r['quantity']:15s} measured {r['measured']:.4g} predicted {r['predicted']:.4g} "
        f"({r['rel_error']:+.1%})"
        for r in rows
    )
    quantities = {(r["point"], r["quantity"]) for r in rows}
    assert ("lazytrain-paper-qwen3.6-27b-h800", "peak_gpu_bytes") in quantities
    assert ("megatrain-qwen2.5-7b-h100", "tflops") in quantities
    for r in rows:
        assert abs(r["rel_error"]) <= TOLERANCE, table


def test_paper_point_is_predicted_from_the_milp_plan():
    pred = predict_point("lazytrain-paper-qwen3.6-27b-h800")
    assert pred["plan_source"] == "milp"
    assert pred["peak_gpu_bytes"] <= get_profile("h800").default_gpu_budget()
    assert pred["tflops"] == pytest.approx(tflops_6n(26_895_998_464, 72 * 395, pred["step_time_s"]))


def test_fit_recovers_the_bundled_gemm_efficiency():
    eta = calibration.fit_efficiency("megatrain-qwen2.5-7b-h100", "gemm", lo=0.2)
    assert eta == pytest.approx(get_profile("h100").achievable_fraction, rel=0.05)
    with pytest.raises(ValueError, match="calibration point 'nope'"):
        get_point("nope")


def test_cpu_layer_times_match_measured_compute():
    """On the CPU device the per-class terms at measured rates give a decoder layer's forward and backward time:
    within 35% of the same layer timed (process CPU time, one thread, so other tenants of the machine do not count).

    One probe of a few milliseconds swings by up to 1.6x on a shared VM (the layer-shape GEMM rate 0.057-0.092
    TFLOPS in one process, 2026-12-03), and one round's prediction against its own layer timing by up to 1.26x
    (1.55x seen once in CI): so a warm-up round, then five rounds, each measuring the rates and timing the layer
    back to back, and the ratio of the least predicted to the least measured time (noise only adds time, as
    `timeit` reasons). On a 2-core machine: the medians of rounds were 1.52 / 1.37 in a suite run beside four
    data-parallel ranks (failed); with three CPU-bound processes beside it, rounds 0.68-1.54, medians 0.99 / 1.13,
    least times 0.99 / 0.97 (2026-12-03)."""
    import dataclasses
    import time

    import torch

    transformers = pytest.importorskip("transformers")
    from lazytrain_hf.planner.hardware import measure

    cfg = transformers.AutoConfig.for_model(
        "qwen3",
        hidden_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1024,
        vocab_size=1024,
        use_cache=False,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rounds = []
    try:
        for _ in range(6):
            prof = measure(
                device="cpu", config=cfg, micro_batch_size=2, seq_len=256, use_cache=False, repeats=5,
                timer=time.process_time, copy_bytes=16 << 20, nvme_bytes=4 << 20, optimizer_params=1_000_000,
            )  # fmt: skip
            measured = prof.layer_times["full_attention"]
            cm = CostModel.from_config(cfg, dataclasses.replace(prof, layer_times={}, layer_times_shape=[]), 256, 2, 4)
            assert cm.serial_lanes and not cm.measured
            lc = cm.layers[0]
            rounds.append(((lc.fwd_s, lc.bwd_s), tuple(measured), prof.summary()))
    finally:
        torch.set_num_threads(threads)
    rounds = rounds[1:]  # the warm-up round
    # each side's least time over the rounds: another tenant only ever adds time (to a probe or to the layer)
    ratios = [min(r[0][i] for r in rounds) / min(r[1][i] for r in rounds) for i in (0, 1)]
    assert all(0.65 < r < 1.35 for r in ratios), (ratios, rounds)
