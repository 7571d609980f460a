"""The step's entries: every saved tensor (or recompute input) stored this step, per layer, and their tiers.

Owns `EntryStore`, shared by the router (`engine.py`) and the recomputer (`recompute.py`), which both store tensors
through it: keep one on the device (`EntryStore.keep`), hand one to the tier its layer plan names
(`EntryStore.offload`), get an entry's device tensor back (`EntryStore.materialize`), and give an entry back when
its last holder drops it (`EntryStore.drop_holder`, `EntryStore.release`). Which tier a tensor goes to is the
caller's decision (from the plan); how its bytes move is the tiers' (`tiers.py`, `nvme.py`).
"""

from __future__ import annotations

import torch

from .layout import Layout
from .nvme import NvmeTier
from .tiers import Entry, Tier, TierContext


class EntryStore:
    """The entries of one activation engine's current step, by layer, and the tiers that hold their bytes.

    Args:
        tiers: the context the tiers share (device, lanes, accountant, pool, in-flight offload sources).
        tier: tier name (``"gpu"``, ``"cpu"``, ``"nvme"``) -> its backend.
        nvme: the NVMe tier when there is one (its failed writes are raised on the calling thread), else None.
    """

    def __init__(self, tiers: TierContext, tier: dict[str, Tier], nvme: NvmeTier | None) -> None:
        self.tiers = tiers
        self.tier = tier
        self.nvme = nvme
        self.entries: dict[int, list[Entry]] = {}  # layer -> entries of the current step

    def keep(self, layer: int, t: torch.Tensor) -> Entry:
        """Keep ``t`` on the device as an entry of ``layer``."""
        entry = self.tier["gpu"].store(layer, t, None)
        self.entries.setdefault(layer, []).append(entry)
        return entry

    def offload(self, layer: int, tier: str, t: torch.Tensor, layout: Layout | None = ...) -> Entry:
        """Hand ``t`` to ``tier``; ``layout`` is `Layout.of(t)` when the caller already has it."""
        if layout is ...:
            layout = Layout.of(t)
        if layout is None:  # overlapping view: see Note: [Saved tensors are restored with their layout]
            return self.keep(layer, t)
        entry = self.tier[tier].store(layer, t, layout)
        self.entries.setdefault(layer, []).append(entry)
        self.tiers.poll_inflight()
        self.raise_write_failure()
        return entry

    def materialize(self, entry: Entry) -> torch.Tensor:
        """The device tensor of an entry, reloading on demand and waiting for the reload."""
        return self.tier[entry.tier].materialize(entry)

    def drop_holder(self, entry: Entry) -> None:
        """One holder of ``entry`` let it go; the last one releases it."""
        with self.tiers.acct.lock:
            entry.holders -= 1
            last = entry.holders <= 0
        if last:
            # outside the lock: releasing waits for I/O threads, which take the lock to account bytes
            self.release(entry)

    def release(self, entry: Entry) -> None:
        """Give back everything an entry holds (device tensors, host buffer, file bytes). Idempotent."""
        self.tier[entry.tier].release(entry)

    def raise_write_failure(self) -> None:
        """Raise a failed spill write (`ActivationSpillError`) on the calling thread; a no-op without the nvme tier."""
        if self.nvme is not None:
            self.nvme.raise_write_failure()
