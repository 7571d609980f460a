"""Data-parallel gradient averaging of a streamed model: the once-per-step reduction of a layer's gradients.

`LazyTrainer` hands `all_reduce_mean` the gradients of one layer (or of the resident parameters) with the process
group to reduce them on: the host fp32 accumulators on their own gloo group (Note: [Data parallel reduces the host
accumulators once per step] in streaming/gradients.py), the resident parameters' device gradients on the default one.
"""

from __future__ import annotations

from typing import Any

import torch


def all_reduce_mean(grads: list[torch.Tensor], group: Any = None) -> None:
    """Average ``grads`` over the data-parallel ranks in place, in fp32.

    Large fp32 tensors are reduced where they are (no copy); the others (bf16 gradients, small fp32 ones such as
    norms and adapters) go through one fp32 buffer, which is the upcast of a bf16 one, reduced in one call and
    copied back: a bf16 result is the rank mean within one rounding of bf16 (``2^-8`` relative)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    in_place = [g.dtype == torch.float32 and (len(grads) == 1 or g.numel() >= 1 << 16) for g in grads]
    low = [g for g, keep in zip(grads, in_place) if not keep]
    for g, keep in zip(grads, in_place):
        if keep:
            dist.all_reduce(g, group=group)
            g.div_(world)
    if low:
        flat = torch.empty(sum(g.numel() for g in low), dtype=torch.float32, device=low[0].device)
        offset = 0
        for g in low:
            flat[offset : offset + g.numel()].copy_(g.reshape(-1))
            offset += g.numel()
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        offset = 0
        for g in low:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
