"""Live bytes of the CPU allocator over a region, from its own allocation records (the counting allocator).

torch's CPU allocator keeps no statistics one can read (`torch.cuda.memory_stats` has no CPU counterpart), but with
the profiler's memory profiling on it reports every allocation and free with its size (``c10``'s
``reportMemoryUsageToProfiler``). `AllocationTrace` records those events and replays them in time order: the live
bytes at every moment relative to the start of the region, so ``peak`` is the largest number of bytes allocated
during the region beyond what was live when it began (frees of older tensors count as negative). Transients inside
an op (a kernel's temporaries) are included: they go through the same allocator.
"""

from __future__ import annotations

import gc

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


class AllocationTrace:
    """``with AllocationTrace() as tr: ...`` then ``tr.peak`` / ``tr.end`` (bytes relative to the start)."""

    def __enter__(self) -> AllocationTrace:
        # Python's cycle collector would free garbage of earlier code inside the region: negative events that lower
        # the measured peak by whatever it held (a sweep of many tests in one process measured 5-15% low)
        gc.collect()
        self._gc = gc.isenabled()
        gc.disable()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        if self._gc:
            gc.enable()
        events = []
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation and str(e.extra_fields.device) == "cpu":
                events.append((e.start_time_ns, e.extra_fields.alloc_size))
            stack.extend(e.children)
        events.sort()
        level = peak = 0
        for _, size in events:
            level += size
            peak = max(peak, level)
        self.peak, self.end, self.events = peak, level, len(events)


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def executor_step_peak(model, plan, input_ids: torch.Tensor, steps: int = 2, micro_batches: int = 1) -> int:
    """The executor's device peak over one training step (forward, chunked loss, backward, the global gradient norm
    that clipping takes before the optimizer step) of ``plan`` on the CPU device, from the allocator's own records:
    the device bytes the executor holds when the step begins (slot pools, resident parameters;
    `StreamHandle.memory_stats`) plus the allocator's peak increment over the step. The last of ``steps`` steps is
    measured (the first ones fill the host buffer pools). A step of ``micro_batches`` accumulates the gradients of
    that many forward and backward passes before the norm. Run it on the synchronous engine: the profiler records only
    the calling thread's allocations, and a worker thread's frees would be missed."""
    from lazytrain_hf.streaming import attach

    handle = attach(model, plan=plan)
    try:
        for _ in range(steps):
            start = handle.memory_stats()["device_bytes"]
            with AllocationTrace() as tr:
                for _ in range(micro_batches):
                    loss = handle.causal_lm_loss(model, {"input_ids": input_ids, "labels": input_ids})
                    loss.backward()
                    del loss
                handle.grad_sq_norms()  # the trainer's clip / logged grad norm (`global_grad_norm`)
            handle.zero_grad()
    finally:
        handle.remove()
    return start + tr.peak
