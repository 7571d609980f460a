"""The executor's trace of the first optimizer steps, written beside the plan (Note: [The trace is the planner's
referee]).

Owns `TRACE_FILE`, `write_trace` (the first steps of a `StepTrace` as JSON in ``output_dir``) and `untraced` (a block
the trace does not record: evaluation and prediction between steps). Takes the `StreamHandle` or its trace as a
plain object.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

# Note: [The trace is the planner's referee]
#     The executor records every transfer, compute span, optimizer update and host synchronisation of a step
#     (`lazytrain_hf.streaming.trace`); the first ``stream_trace_steps`` optimizer steps are written to
#     ``output_dir/lazytrain_trace.json`` (``{"steps": [{"bytes": {"h2d", "d2h", "nvme_read", "nvme_write"}, ...}]}``),
#     beside the plan whose ``predicted["bytes_per_step"]`` they must equal. Evaluation and prediction between steps
#     are not recorded.
TRACE_FILE = "lazytrain_trace.json"


@contextlib.contextmanager
def untraced(handle: Any) -> Iterator[None]:
    """Pause the trace of ``handle`` (a `StreamHandle`, or None: nothing to pause) for the block."""
    if handle is None:
        yield
        return
    with handle.trace.paused():
        yield


def write_trace(trace: Any, output_dir: str, steps: int) -> None:
    """Write the first ``steps`` steps of ``trace`` to ``output_dir``/`TRACE_FILE` (nothing without a trace, steps or
    recorded steps)."""
    if trace is None or steps <= 0 or not trace.steps:
        return
    os.makedirs(output_dir, exist_ok=True)
    trace.to_json(os.path.join(output_dir, TRACE_FILE), max_steps=steps)
