"""Memory-bound traffic terms that the cost model (`costmodel`) and the CPU probes (`probes.measure`) count the same
way: the bytes an RMSNorm saves for backward, and how many passes over the saved bytes a layer's memory-bound work
makes in forward and backward. The lowest planner module: it imports nothing of the package."""

from __future__ import annotations

FP32 = 4

# Memory-bound traffic per byte saved for backward: a saved tensor is written by its producer and read by its
# consumer in forward (2x); backward reads it once and writes and reads an activation gradient of its size (3x).
# The saved bytes are exact (checked against autograd), so this counts the norms, activations, casts, softmax and
# the fp32 delta-rule elementwise work of each layer kind through one audited figure.
MEMORY_PASSES_FWD = 2.0
MEMORY_PASSES_BWD = 3.0


def rmsnorm_saved(rows: int, width: int, db: int, one_plus_weight: bool) -> int:
    """What an RMSNorm saves (its output is counted by its consumer), in bytes; ``db`` the compute dtype's bytes.

    Qwen2/Qwen3 RMSNorm: ``x32 = x.float()`` (pow, mul), ``rsqrt`` (mul), ``normed.to(dtype)`` (weight mul).
    Qwen3.5 (1 + w) RMSNorm: ``x32``, ``rsqrt``, the fp32 ``(1 + w)`` and the fp32 normalized ``x32 * rsqrt``.
    """
    if one_plus_weight:
        return rows * width * FP32 + rows * FP32 + width * FP32 + rows * width * FP32
    return rows * width * FP32 + rows * FP32 + rows * width * db
