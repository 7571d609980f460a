"""The executor's trace: what one training step really moved, computed and waited for.

Every host <-> device copy and every NVMe read or write the executor issues is recorded here with its lane, bytes,
dtype, layer, what it is and the stage it was issued in; every compute span (layer forward, backward, recomputation)
and every optimizer update with its clock; and every time the host blocks on device work (``host_sync``). The trace
is the referee of the planner: bytes are deterministic, so a plan's ``predicted["bytes_per_step"]``
(`lazytrain_hf.planner.schedule.bytes_per_step`) must equal the trace's per-lane totals exactly, and measured
compute spans (not the wall time of a stage, which includes transfer waits) are what the timed warm-up feeds the
cost model.

Steps are optimizer steps: the trainer calls `end_step` after issuing the update (`LazyTrainer`); used
standalone (no optimizer), call it after each backward. Work that belongs to a step but runs later (an overlapped
optimizer update and the uploads it issues) is recorded with the step index taken when it was issued, so totals
never depend on timing. The detailed records (transfers, spans) are kept for the first ``keep_steps`` steps and the
per-step totals for those and the last `TOTALS_KEPT` steps, so the trace stays small over a long run.

Lanes (`LANES`): ``h2d`` and ``d2h`` (host <-> device), ``nvme_read`` and ``nvme_write`` (disk <-> host), ``net``
(between data-parallel ranks: ``reduce``, a unit's fp32 gradient sent to its owner, per micro-batch, or per step with
the plan's ``dp_reduce_every == "step"`` (Note: [Gradients reduced once per step] in gradients.py); ``gather``, a
unit's compute copy received from its owner on another node, per step; Note: [Partitioned gradients are reduced to
their owner every micro-batch] in gradients.py, Note: [The node's compute copy is shared by its ranks] in
training/dataparallel.py). On the CPU
device a "transfer" is the copy between the host store and a device slot that the CUDA path makes over PCIe, and
it is recorded the same way, so a plan's bytes are checked on CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

LANES: tuple[str, ...] = ("h2d", "d2h", "nvme_read", "nvme_write", "net")
DEFAULT_KEEP_STEPS = 3
TOTALS_KEPT = 1024  # per-step totals kept beyond the detailed steps


def _dtype_name(dtype: torch.dtype | str | None) -> str | None:
    if dtype is None or isinstance(dtype, str):
        return dtype
    return str(dtype).removeprefix("torch.")


class Trace:
    """Per-step record of the executor's transfers, compute spans, optimizer updates and host synchronisations.

    Args:
        keep_steps: steps whose detailed records are kept (totals: those and the last `TOTALS_KEPT` steps).
        clock: the timer of compute spans and updates (``time.perf_counter`` by default; spans recorded with CUDA
            events are converted to seconds when the step is read).
    """

    def __init__(self, keep_steps: int = DEFAULT_KEEP_STEPS, clock=time.perf_counter, device: Any = "cpu"):
        if keep_steps < 0:
            raise ValueError(f"keep_steps={keep_steps} must be >= 0.")
        self.keep_steps = keep_steps
        self.clock = clock
        self.step_index = 0
        self.stage: int | str = -1  # the executor's current stage (set by the scheduler)
        self._steps: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self.enabled = True
        # CUDA: compute spans are pairs of timing events on the compute stream, resolved when a step is read, so
        # recording one never blocks the host; elsewhere the clock's seconds
        self._cuda = torch.device(device).type == "cuda"
        self._origin = None

    def __repr__(self) -> str:
        return f"Trace(steps={len(self._steps)}, keep_steps={self.keep_steps}, current={self.step_index})"

    # ------------------------------------------------------------------ recording
    @contextlib.contextmanager
    def in_step(self, step: int) -> Iterator[None]:
        """Records made by this thread inside the block belong to ``step`` (an overlapped optimizer update runs
        while the next step has begun)."""
        prev = getattr(self._local, "step", None)
        self._local.step = step
        try:
            yield
        finally:
            self._local.step = prev

    def _step(self, step: int | None) -> dict[str, Any]:
        if step is None:
            step = getattr(self._local, "step", None)
        k = self.step_index if step is None else step
        s = self._steps.get(k)
        if s is None:
            s = self._steps[k] = {
                "step": k,
                "bytes": {lane: 0 for lane in LANES},
                "host_syncs": 0,
                "sync_reasons": {},
                "transfers": [],
                "compute": [],
                "updates": [],
            }
        return s

    def _detailed(self, k: int) -> bool:
        return k < self.keep_steps

    def transfer(
        self,
        lane: str,
        nbytes: int,
        dtype: torch.dtype | str | None,
        layer: int | None,
        what: str,
        step: int | None = None,
    ) -> None:
        """One copy of ``nbytes`` on ``lane`` (`LANES`), issued now (in the current stage)."""
        if not self.enabled:
            return
        if lane not in LANES:
            raise ValueError(f"lane={lane!r} is not a trace lane; use one of {LANES}.")
        with self._lock:
            s = self._step(step)
            s["bytes"][lane] += int(nbytes)
            if self._detailed(s["step"]):
                s["transfers"].append(
                    {
                        "lane": lane,
                        "bytes": int(nbytes),
                        "dtype": _dtype_name(dtype),
                        "layer": layer,
                        "what": what,
                        # before F_0 (the embedding's forward) is stage 0's start
                        "stage_issued": max(self.stage, 0),
                    }
                )

    def waited(self, layer: int | None, what: str) -> None:
        """The compute side waits for the earliest ``what`` transfer of ``layer`` onto the device (lane ``h2d``) not
        waited for yet (records the stage it does so in ``stage_waited``); the NVMe read before it is the host's."""
        if not self.enabled or layer is None:
            return
        with self._lock:
            s = self._steps.get(self.step_index)
            if s is None or not self._detailed(s["step"]):
                return
            for t in s["transfers"]:
                if t["lane"] == "h2d" and t["layer"] == layer and t["what"] == what and "stage_waited" not in t:
                    t["stage_waited"] = max(self.stage, 0)
                    return

    def host_sync(self, reason: str, step: int | None = None) -> None:
        """The host blocked on device work (an event's ``synchronize``, a drained lane, a blocking copy)."""
        if not self.enabled:
            return
        with self._lock:
            s = self._step(step)
            s["host_syncs"] += 1
            s["sync_reasons"][reason] = s["sync_reasons"].get(reason, 0) + 1

    def mark(self) -> Any:
        """A point on the compute side's timeline: the clock's seconds, or on CUDA a timing event on the current
        stream (its time is when the stream reaches it, so waits queued before it are excluded)."""
        if not self._cuda:
            return self.clock()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        if self._origin is None:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
        return ev

    def span(self, kind: str, layer: int | None, start: Any, end: Any, step: int | None = None) -> None:
        """A compute span (``kind``: ``forward``, ``backward``) between two `mark` results."""
        if not self.enabled:
            return
        with self._lock:
            s = self._step(step)
            if self._detailed(s["step"]):
                s["compute"].append({"kind": kind, "layer": layer, "start": start, "end": end})

    def _resolve(self, spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for sp in spans:
            a, b = sp["start"], sp["end"]
            if not isinstance(a, float | int):
                b.synchronize()
                a, b = self._origin.elapsed_time(a) / 1e3, self._origin.elapsed_time(b) / 1e3
            out.append({**sp, "start": a, "end": b, "seconds": b - a})
        return out

    def compute_seconds(self, kind: str, step: int | None = None) -> dict[int, list[float]]:
        """``{layer: [seconds of each span of kind]}`` over the detailed steps (or one ``step``)."""
        out: dict[int, list[float]] = {}
        for s in self.steps if step is None else [self._steps[step]]:
            for sp in self._resolve(s["compute"]):
                if sp["kind"] == kind:
                    out.setdefault(sp["layer"], []).append(sp["seconds"])
        return out

    def update(self, layer: int | str, start: float, end: float, step: int | None = None) -> None:
        """One optimizer update (a layer, or ``"resident"``)."""
        if not self.enabled:
            return
        with self._lock:
            s = self._step(step)
            if self._detailed(s["step"]):
                s["updates"].append({"layer": layer, "start": start, "end": end})

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside the block (evaluation or generation between training steps)."""
        prev, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = prev

    def end_step(self) -> None:
        """The optimizer step was issued: later records belong to the next step."""
        with self._lock:
            self._step(None)
            self.step_index += 1
            # bounded over a long run: the detailed first steps and the totals of the last `TOTALS_KEPT` steps
            old = self.step_index - TOTALS_KEPT - 1
            if old >= self.keep_steps:
                self._steps.pop(old, None)

    # ------------------------------------------------------------------ reading
    @property
    def current(self) -> dict[str, Any]:
        """The step in progress (created empty if nothing was recorded yet)."""
        with self._lock:
            return self._step(None)

    @property
    def steps(self) -> list[dict[str, Any]]:
        """Completed steps, in order (the step in progress excluded)."""
        with self._lock:
            return [self._steps[k] for k in sorted(self._steps) if k < self.step_index]

    def bytes_per_step(self) -> list[dict[str, int]]:
        return [dict(s["bytes"]) for s in self.steps]

    def to_dict(self, max_steps: int | None = None) -> dict[str, Any]:
        steps = self.steps if max_steps is None else self.steps[:max_steps]
        return {"lanes": list(LANES), "steps": [{**s, "compute": self._resolve(s["compute"])} for s in steps]}

    def to_json(self, path: str, max_steps: int | None = None) -> str:
        text = json.dumps(self.to_dict(max_steps), indent=1)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        return path

    def reset(self) -> None:
        with self._lock:
            self._steps.clear()
            self.step_index = 0
