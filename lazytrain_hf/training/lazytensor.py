"""`LazyTensor`: a tensor's dtype and shape now, its values read only when they are written.

The checkpoint writer (`checkpoints.write_safetensors`, `checkpoints.write_model_weights`) takes these for tensors
whose values live elsewhere until then (a state file on NVMe, a conversion back to the model's dtype), so it can lay
out a file's header before reading any of them. A leaf module: it imports nothing of the package.
"""

from __future__ import annotations

import torch


class LazyTensor:
    """A tensor read only when it is written (`write_safetensors`): ``dtype``, ``shape`` and ``read()``."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], read):
        self.dtype, self.shape, self.read = dtype, tuple(shape), read
