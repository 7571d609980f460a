"""lazytrain_hf: fine-tune Qwen-family LLMs larger than the GPU inside the HuggingFace Trainer.

Heavy modules (Trainer, torch hooks) load on first use, so ``lazytrain plan`` starts without importing
`transformers.Trainer`.

Map of the package (each module's docstring says what it owns and what it may not touch):

- `args` (`LazyTrainingArguments`), `trainer` (`LazyTrainer`: the Trainer overrides, orchestration only);
  `training/`: `planning` (profile, warm-up, plan files, host check), `checkpoints` (atomic save, fp32 masters,
  verification), `updater` (`LayerwiseUpdater`, the layer-wise optimizer step and its ordering guards);
- `streaming/`: the executor: `store` (host store), `engine` (slot pool and copies), `hooks` (`attach`,
  `StreamHandle`, forward hooks), `binder`, `scheduler`, `completion`, `gradients`, `units` (streamed embeddings and
  head), `loss` (chunked loss);
- `activations/`: where saved activations live: `engine` (the router), `tiers` and `nvme` (tier backends),
  `recompute`, `layout`, `pool`, `accounting`;
- `streams`: copy lanes (CUDA streams, or the simulated asynchronous CPU engine, ``LAZYTRAIN_SIMULATE_ASYNC=1``);
- `planner/`: `plan` (the `Plan`), `hardware`, `costmodel`, `stages` (evaluate a plan), `formulation` (the MILP),
  `solver`, `search`, `heuristics`, `milp` (entry point), `baselines`, `simulate`, `zoo`;
- `optim/`: `HybridAdamW8bit` (`hybrid8bit`), its 8-bit state (`quant`), kernels (`kernels`, `native`), `clip`;
- `loading` (`from_pretrained`: decoder-layer weights left on disk until the host store reads them);
- `models` (one table of the Qwen families), `data` (MetaMathQA), `cli` (``lazytrain``), `units`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .training.arg_upgrades import register_upgrade

__version__ = "0.1.0"

_LAZY = {
    "LazyTrainer": "lazytrain_hf.trainer",
    "LazyTrainingArguments": "lazytrain_hf.args",
    "Plan": "lazytrain_hf.planner.plan",
    "LayerPlan": "lazytrain_hf.planner.plan",
    "HybridAdamW8bit": "lazytrain_hf.optim",
    "from_pretrained": "lazytrain_hf.loading",
    # the `trl` extra (pip install 'lazytrain-hf[trl]'); importing them without trl raises an ImportError saying so
    "LazySFTConfig": "lazytrain_hf.trl",
    "LazySFTTrainer": "lazytrain_hf.trl",
}

# LazySFTConfig / LazySFTTrainer are left out: `from lazytrain_hf import *` must work without trl installed
__all__ = ["HybridAdamW8bit", "LayerPlan", "LazyTrainer", "LazyTrainingArguments", "Plan", "from_pretrained"]

if TYPE_CHECKING:  # pragma: no cover
    from .args import LazyTrainingArguments
    from .loading import from_pretrained
    from .optim import HybridAdamW8bit
    from .planner.plan import LayerPlan, Plan
    from .trainer import LazyTrainer
    from .trl import LazySFTConfig as LazySFTConfig  # re-exported (not in __all__, see above)
    from .trl import LazySFTTrainer as LazySFTTrainer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lazytrain_hf' has no attribute {name!r}")


def _lazy_sft_config() -> type:
    from .trl import LazySFTConfig

    return LazySFTConfig


# trl's SFTConfig upgrades to LazySFTConfig (`lazytrain_hf.args.upgraded_class`); lazytrain_hf.trl is imported only
# when one is upgraded
register_upgrade("trl.", "SFTConfig", _lazy_sft_config)
