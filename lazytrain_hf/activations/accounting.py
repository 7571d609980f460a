"""Accounting of saved activations: bytes per tier (gpu / cpu / nvme), now and at peak.

Owns `Accountant`. Device bytes count unique storages (reference-counted by storage address), so views and
tensors shared between entries are counted once.
"""

from __future__ import annotations

import threading

import torch

from .layout import storage_key


class Accountant:
    """Bytes of saved activations per tier, with peaks. Device bytes count unique storages (refcounted)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._storages: dict[int, list[int]] = {}  # storage ptr -> [refcount, nbytes]
        self.cur = {"gpu": 0, "cpu": 0, "nvme": 0}
        self.peak = {"gpu": 0, "cpu": 0, "nvme": 0}

    def add_storage(self, t: torch.Tensor) -> tuple[int, int]:
        """Count ``t``'s storage once; returns ``(key, bytes newly counted)``."""
        key = storage_key(t)
        with self.lock:
            rec = self._storages.get(key)
            if rec is not None:
                rec[0] += 1
                return key, 0
            n = t.untyped_storage().nbytes()
            self._storages[key] = [1, n]
            self.add("gpu", n)
            return key, n

    def remove_storage(self, key: int) -> None:
        with self.lock:
            rec = self._storages.get(key)
            if rec is None:
                return
            rec[0] -= 1
            if rec[0] == 0:
                del self._storages[key]
                self.add("gpu", -rec[1])

    def add(self, tier: str, n: int) -> None:
        with self.lock:
            self.cur[tier] += n
            if self.cur[tier] > self.peak[tier]:
                self.peak[tier] = self.cur[tier]

    def reset_peak(self) -> None:
        with self.lock:
            self.peak = dict(self.cur)

    def clear(self) -> None:
        with self.lock:
            self._storages.clear()
            self.cur = {"gpu": 0, "cpu": 0, "nvme": 0}
