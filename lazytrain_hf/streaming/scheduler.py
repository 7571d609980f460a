"""Fetch scheduler of the streaming executor: what is issued at each stage, and what a fetch must wait for.

Owns the stage counter of a step (``_stage``), the plan's issue schedule (``_schedule``, ``_bwd_issue``), deferred
issues (a prefetch that found no free slot, or whose layer's update is not done yet, is retried at the next stage
or when a slot is released), and the guards that order the optimizer against the executor: ``fetch_guard`` (update
before fetch, and before a resident layer's forward), ``fetch_ready`` (the non-blocking form a prefetch asks, Note:
[A prefetch never waits for the optimizer]),
``resident_guard`` (every forward waits for the non-streamed parameters' update), the release and upload of
resident slots, and `sync_compute`. It does not bind parameters (`binder.py`) or move gradients (`gradients.py`).
"""

from __future__ import annotations


class FetchScheduler:
    """`StreamHandle`'s transfer scheduling and optimizer-side ordering (see the module docstring).

    Note: [A prefetch never waits for the optimizer]
        With the optimizer overlapping the next forward, a prefetch may be issued for a layer whose update of the
        previous step is still running. ``fetch_guard(i)`` would block the host (and with it every kernel launch of
        the layers in flight) until that update is done; instead a prefetch asks ``fetch_ready(i)`` (non-blocking,
        `LayerwiseUpdater.layer_updated`) and, when the update is not done, is deferred like a prefetch that found
        no free slot: retried at the start of the next stage and whenever a slot is released. Only an urgent fetch
        (the layer is needed now) waits in ``fetch_guard``. Without ``fetch_ready`` every fetch waits as before.
        Test: ``tests/test_cuda_path.py::test_prefetch_deferred_while_layer_updates`` (deferrals counted, values
        bit-exact with the run without overlap).
    """

    # Note: [A prefetch never waits for the optimizer]: fetch_ready(layer) -> whether a fetch may read the layer's
    # host compute copy now (its update is done); set by the layer-wise updater next to ``fetch_guard``
    fetch_ready = None
    fetch_deferrals: int = 0  # prefetches deferred because their layer's update was not done
    nvme_state = None  # the state on NVMe of the units in plan.state_nvme (lazytrain_hf.streaming.nvmestate)

    def _fetch(self, i: int, urgent: bool) -> bool:
        st = self._all[i]
        if st.store is None or st.slot is not None:
            return True
        if self.fetch_guard is not None:
            if not urgent and self.fetch_ready is not None and not self.fetch_ready(i):
                self.fetch_deferrals += 1  # Note: [A prefetch never waits for the optimizer]
                return False
            self.fetch_guard(i)
        if st.transient:
            slot = self.engine.transient_slot(st.kind, st.store.nbytes)
        else:
            slot = self.engine.acquire(st.kind, urgent)
        if slot is None:
            return False
        spill = self.nvme_state
        if spill is not None and i in spill.units:
            # the compute copy is read from NVMe into a host window first: on the state's reader thread, which then
            # issues the H2D copy (Note: [A fetch from NVMe is read off the step's threads] in nvmestate.py)
            if self.engine.is_async:
                self.engine.copy_in_from_read(
                    slot, spill.units[i].compute_bytes, i, lambda issue: spill.fetch(i, issue)
                )
            else:
                self.engine.copy_in(slot, spill.read_compute(i), i)
        else:
            self.engine.copy_in(slot, st.store.compute_bytes, i)
        st.slot = slot
        return True

    def _retry_deferred(self) -> None:
        pending, self._deferred = self._deferred, []
        for what, i in pending:
            st = self._all[i]
            if what == "fetch_fwd" and (self._phase != "forward" or self._stage >= i):
                continue  # its forward already ran (fetched on demand)
            if what == "fetch_bwd" and (st.completed or st.bwd_started):
                continue
            self._issue(what, i)

    def _issue(self, what: str, i: int) -> None:
        if what == "reload":
            if self._grad_step:
                self.activations.prefetch(i)
            return
        if what == "fetch_bwd":
            if not self._grad_step:
                return
            self._all[i].want_bwd = True
        if not self._fetch(i, urgent=False):
            self._deferred.append((what, i))

    def _run_stages(self, s: int) -> None:
        """Start every stage up to ``s`` not started yet: issue what the plan lists for it."""
        while self._stage < s:
            self._stage += 1
            if self._deferred:
                self._retry_deferred()  # Note: [A prefetch never waits for the optimizer]
            for what, i in self._schedule.get(self._stage, ()):
                self._issue(what, i)

    def _wait_resident_params(self) -> None:
        if self.resident_guard is not None:
            self.resident_guard()

    def mark_resident_released(self) -> None:
        """The step's compute is queued: the optimizer's uploads into resident slots may follow it (call on the
        training thread after backward). See Note: [Slot reuse waits for the compute event] in engine.py."""
        for st in self._layers:
            if st.resident and st.slot is not None:
                self.engine.mark_released(st.slot)

    def wait_uploads(self) -> None:
        """Make the compute side wait for the optimizer's uploads into resident slots, so that anything reading the
        model's weights next (a callback, a checkpoint, evaluation) sees the updated values. See Note: [Compute
        waits for the H2D event] in engine.py."""
        for st in self._layers:
            if st.resident and st.slot is not None:
                self.engine.wait_ready(st.slot)

    def sync_compute(self, layer: int | None = None, compute_written: bool = False) -> None:
        """Refresh the compute copy (and the device copy of plan-resident layers) from the fp32 master after the
        optimizer changed it; ``layer=None`` does all layers. ``compute_written``: the optimizer already wrote the
        host compute copy (``out_bf16``, after `TransferEngine.wait_host_reads`); only the resident upload is left.
        """
        idx = list(self.store.layers) if layer is None else [layer]
        for i in idx:
            if i not in self.store.layers:
                raise ValueError(
                    f"sync_compute(layer={i}): layer {i} has no streamed parameters; valid: "
                    f"{sorted(self.store.layers)}."
                )
            ls = self.store.layers[i]
            if not compute_written:
                self.engine.wait_host_reads(i)  # Note: [Host compute copy is not rewritten while a fetch reads it]
                ls.sync()
            st = self._all[i]
            if st.resident:
                self.engine.upload(st.slot, ls.compute_bytes)
