"""Hybrid 8-bit optimizer: CPU AdamW with block-wise 8-bit moments, and fast gradient clipping."""

from .clip import (
    GradNormAccumulator,
    clip_coefficient,
    global_norm,
    norm_is_finite,
    partial_sq_norms,
    sq_norm,
)
from .hybrid8bit import HybridAdamW8bit
from .kernels import BACKEND_ENV, NUMBA_AVAILABLE, AdamWScalars, adamw8bit_step, resolve_backend
from .quant import Quantized8bit, create_dynamic_map

__all__ = [
    "BACKEND_ENV",
    "NUMBA_AVAILABLE",
    "AdamWScalars",
    "GradNormAccumulator",
    "HybridAdamW8bit",
    "Quantized8bit",
    "adamw8bit_step",
    "clip_coefficient",
    "create_dynamic_map",
    "global_norm",
    "norm_is_finite",
    "partial_sq_norms",
    "resolve_backend",
    "sq_norm",
]
