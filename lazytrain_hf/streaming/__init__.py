"""The layer-streaming executor: host store, device slot pool, module/autograd hooks, chunked loss.

```python
from lazytrain_hf.streaming import attach

handle = attach(model)  # default plan: every layer streamed, prefetch depth 1, activations kept
loss = handle.causal_lm_loss(model, batch)
loss.backward()
grads = handle.grads()  # fp32 host gradients keyed by parameter name
handle.remove()  # the model is exactly as before
```
"""

from __future__ import annotations

from .engine import Slot, TransferEngine
from .hooks import StreamHandle, attach
from .loss import chunked_causal_lm_loss
from .store import HostStore, LayerStore

__all__ = [
    "attach",
    "StreamHandle",
    "chunked_causal_lm_loss",
    "HostStore",
    "LayerStore",
    "TransferEngine",
    "Slot",
]
