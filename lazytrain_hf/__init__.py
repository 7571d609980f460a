"""lazytrain_hf: fine-tune Qwen-family LLMs larger than the GPU inside the HuggingFace Trainer.

Heavy modules (Trainer, torch hooks) load on first use, so ``lazytrain plan`` starts without importing
`transformers.Trainer`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LazyTrainer": "lazytrain_hf.trainer",
    "LazyTrainingArguments": "lazytrain_hf.args",
    "Plan": "lazytrain_hf.planner.plan",
    "LayerPlan": "lazytrain_hf.planner.plan",
    "HybridAdamW8bit": "lazytrain_hf.optim",
}

__all__ = ["HybridAdamW8bit", "LayerPlan", "LazyTrainer", "LazyTrainingArguments", "Plan"]

if TYPE_CHECKING:  # pragma: no cover
    from .args import LazyTrainingArguments
    from .optim import HybridAdamW8bit
    from .planner.plan import LayerPlan, Plan
    from .trainer import LazyTrainer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lazytrain_hf' has no attribute {name!r}")
