"""Live bytes of the CPU allocator over a region, from its own allocation records (the counting allocator).

torch's CPU allocator keeps no statistics one can read (`torch.cuda.memory_stats` has no CPU counterpart), but with
the profiler's memory profiling on it reports every allocation and free with its size (``c10``'s
``reportMemoryUsageToProfiler``). `AllocationTrace` records those events and replays them in time order: the live
bytes at every moment relative to the start of the region, so ``peak`` is the largest number of bytes allocated
during the region beyond what was live when it began (frees of older tensors count as negative). Transients inside
an op (a kernel's temporaries) are included: they go through the same allocator.
"""

from __future__ import annotations

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


class AllocationTrace:
    """``with AllocationTrace() as tr: ...`` then ``tr.peak`` / ``tr.end`` (bytes relative to the start)."""

    def __enter__(self) -> AllocationTrace:
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
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
