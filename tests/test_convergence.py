"""Convergence on the bundled MetaMathQA sample: the full LazyTrain path (streaming, a planned activation policy,
Hybrid 8-bit) against the unmodified Trainer with fp32 AdamW, both through the recipe.

Measured (recipe defaults, lr 1e-3, 600 eval problems, 800 steps):
- 2026-12-01, 2-core Intel Xeon (AVX-512), Hybrid 8-bit with the non-zero rule for v (issue #14): exact match
  LazyTrain 99.67% vs Trainer 100.00%, final loss 0.0519 vs 0.0520; over the last 40% of the logged steps the loss
  gap is at most 4.7%, mean 0.6%. During the fast-learning phase (steps 160-430) the 8-bit run lags fp32 AdamW by a
  few dozen steps (gaps up to 35%); with the earlier rounding of v (which could round a small v to 0) the same
  machine gave 38.8% there, 7.4% / 1.3% over the last 40%, EM 100.00%.
- 2026-11-29, AMD EPYC, the earlier rounding: EM 100.00% vs 99.50%, loss gap per logged step (from 10% on) at most
  14.7%, mean 3.5%, final 0.0518 vs 0.0523.
- For scale: at 400 steps two fp32 Trainer runs with different seeds reach 88.67% and 78.33% and their loss curves
  differ by 18% on average, so the runs are compared where training has converged (the last 40% of the 800 steps),
  not mid-way.
"""

from __future__ import annotations

import json

import pytest
from conftest import load_recipe

# 72 MiB is between the smallest budget any plan fits (68 MiB at batch 32) and keep-all's peak (182 MiB).
BUDGET = "72MiB"
# Loss curves over the converged phase (the last 40% of the logged steps): per logged step within 20%, mean gap
# within 6%; final loss within 5%. The 8-bit moments and the chunked loss's summation order make the trajectories
# drift apart slowly; mid-training the 8-bit run may lag (see the figures above).
LOSS_RTOL_POINT, LOSS_RTOL_MEAN, LOSS_RTOL_FINAL = 0.20, 0.06, 0.05
EM_POINTS = 0.02  # exact match within 2 points


@pytest.mark.slow
@pytest.mark.sync_engine  # 1600 steps: a numerics check; ordering under simulated asynchrony is test_plan_space's
@pytest.mark.timeout(2400)
def test_lazytrain_converges_like_trainer(tmp_path, evaluate_cache):
    recipe = load_recipe()
    common = ["--logging_steps", "10", "--save_strategy", "no", "--max_steps", "800", "--num_eval_samples", "600"]
    lazy = recipe.main(
        ["--output_dir", str(tmp_path / "lazy"), "--planner_policy", "milp", "--planner_gpu_budget", BUDGET, *common]
    )
    ref = recipe.main(
        ["--output_dir", str(tmp_path / "ref"), "--stream_enabled", "False", "--optim", "adamw_torch", *common]
    )
    plan = json.load(open(tmp_path / "lazy" / "lazytrain_plan.json"))
    assert {lp["policy"] for lp in plan["layers"]} - {"keep"}, plan  # the budget forces recompute / offload
    a, b = lazy["train_losses"], ref["train_losses"]
    assert len(a) == len(b) == 80
    start = len(a) * 6 // 10
    gaps = [abs(x - y) / y for x, y in zip(a[start:], b[start:])]
    print(
        f"loss gap: max {max(gaps):.3%}, mean {sum(gaps) / len(gaps):.3%}, final {a[-1]:.4f} vs {b[-1]:.4f}; "
        f"EM lazy {lazy['exact_match_after']:.2%} vs trainer {ref['exact_match_after']:.2%}"
    )
    assert max(gaps) <= LOSS_RTOL_POINT, list(zip(a, b))
    assert sum(gaps) / len(gaps) <= LOSS_RTOL_MEAN, list(zip(a, b))
    assert abs(a[-1] - b[-1]) <= LOSS_RTOL_FINAL * b[-1]
    assert abs(lazy["exact_match_after"] - ref["exact_match_after"]) <= EM_POINTS
    assert lazy["exact_match_after"] > lazy["exact_match_before"] + 0.5  # it learned
