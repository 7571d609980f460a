"""The optimizer step of a streamed model, layer by layer, in layer order, optionally overlapping the next forward.

Owns `LayerwiseUpdater`: which tensors the optimizer sees (per-layer views of the host store's fp32 masters and
gradient accumulators, fp32 host masters of the resident parameters), when gradients are taken over, the background
update thread and the guards the executor calls before it reads a weight (Note: [Update before fetch]), and the bf16
compute copy written in the same pass (Note: [The compute copy is written in the fused pass]). The update math is
the optimizer's (`HybridAdamW8bit._update`); clipping coefficients and skipped steps are decided by the trainer and
passed in. This module never imports `transformers.Trainer` and allocates neither host store nor device slots: it
writes streamed layers' weights through the `StreamHandle` it is given (``sync_compute``) and resident parameters
in place.
"""

from __future__ import annotations

import threading

import torch

from .. import pinned
from ..streams import SimDelay, simulate_async
from ..threads import background_worker, on_step_path


class LayerwiseUpdater:
    """Runs the optimizer update of a streamed model parameter group by layer, in layer order.

    The optimizer sees, per streamed layer, views of the layer's flat fp32 master with ``.grad`` set to views of its
    flat fp32 gradient accumulator, and one fp32 host master per resident parameter (the parameter itself when it
    already is an fp32 CPU tensor). `run()` updates the resident parameters first (the next forward needs the
    embedding before anything else), then layers 0..L-1, refreshing each layer's compute copy right after its update.

    With ``overlap=True`` the updates run on a background thread and `run()` returns at once, so the next step's
    forward starts while later layers are still being updated.

    Note: [Update before fetch]
        The executor calls `wait_layer(i)` (its ``fetch_guard``) before any fetch of layer ``i`` reads the host
        compute copy and before every forward of a plan-resident layer ``i`` (whose dedicated slot the update
        re-uploads), and `wait_resident()` (its ``resident_guard``) when any forward begins (training, evaluation,
        prediction, generation): nothing reads a weight before its update of the previous step is complete.
        Hyperparameters (lr, betas, eps, weight decay) are frozen when `run()` is called, so an LR scheduler stepping
        while the thread works does not change this step's update. Gradients are taken over at `run()`, after
        `StreamHandle.synchronize` (Note: [Host accumulators are read only after their copy landed] in
        streaming/engine.py): resident ones detached from the parameters, streamed ones read from host buffers the
        next backward only writes after the next forward, which waits for every layer. `run()` also marks the
        resident slots released (the step's compute is queued), so the uploads are ordered after it. Tests:
        ``tests/test_plan_space.py`` (the property test with ``optimizer_overlap`` and resident layers under the
        simulated asynchronous engine, and one regression test per guard).

    Note: [Resident gradients cross asynchronously]
        `run()` takes a resident parameter's device gradient over by issuing its copy to the host on the D2H lane
        (after the compute that produced it), into a staging buffer of the gradient's own dtype (pinned on CUDA,
        reused every step); the update (on the background thread with ``overlap``) waits for that copy's event and
        upcasts into a reused fp32 host gradient, so the training thread never blocks on the copy and a bf16
        gradient moves 2 bytes per parameter. The updated master is converted to the parameter's dtype on the host
        before it is copied back. The trainer clears the model's ``.grad`` right after `run()` (set to None, never
        zeroed in place), so the tensor the copy reads stays as it was. Test:
        ``tests/test_cuda_path.py::test_resident_grads_async_bit_exact`` (bf16, simulated engine, bit-exact with
        the synchronous engine).

    Note: [Resident parameters are uploaded from pinned staging]
        After its update a resident parameter's fp32 master is converted to the parameter's dtype on the host, into
        a staging buffer of its own (pinned on CUDA, reused every step once its previous upload completed), and
        copied on the H2D lane after the compute queued so far (which includes the backward that read the
        parameter; the next forward is not queued yet, it waits in `wait_resident`). `wait_resident` (every
        forward's first wait) and `wait_all` make the compute side wait for those copies' events, so no reader
        sees the old values and the host never blocks on the copy. A bf16 parameter moves 2 bytes per element and
        no fp32 temporary exists on the device. Test: ``tests/test_cuda_path.py::test_resident_grads_async_bit_exact``
        (simulated lanes poison the parameter until the copy lands).

    Note: [The compute copy is written in the fused pass]
        For a layer whose trainable compute copy is bf16 (and not the master itself), the fused optimizer pass
        writes the bf16 weights straight into the host compute copy (``out_bf16``), so no second pass over the layer
        (`LayerStore.sync`) follows. The write waits for fetches still reading the compute copy first (Note: [Host
        compute copy is not rewritten while a fetch reads it] in streaming/engine.py).
    """

    def __init__(self, handle, overlap: bool = False, data_parallel=None):
        self.handle = handle
        self.overlap = overlap
        self.layers: dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}  # i -> [(name, master, grad)]
        for i, ls in sorted(handle.store.layers.items()):
            if ls.master is None:
                continue
            self.layers[i] = [(e.name, ls.master_views[e.name], ls.grad_views[e.name]) for e in ls.trainable_entries]
        # Note: [The node's compute copy is shared by its ranks] (training/dataparallel.py):
        # units another rank updates: one owned on this node is awaited in the node copy at its next fetch
        # (`_await_local`); one owned on another node is received in unit order among this rank's own updates
        self.data_parallel = data_parallel
        self.remote = [i for i, ls in sorted(handle.store.layers.items()) if ls.remote]
        if self.remote and data_parallel is None:
            raise ValueError(
                f"units {self.remote} are updated by other ranks (the host store was built with unit_owners): pass "
                "LayerwiseUpdater(data_parallel=...) to receive their weights."
            )
        self._order = sorted([*self.layers, *self.remote])
        self._local_pending: set[int] = set()  # units of another rank of this node whose update is not awaited yet
        # resident: (name, parameter, fp32 host master). An fp32 CPU parameter is updated in place through an alias
        # (`p.detach()`: same storage, its own `.grad`), so `zero_grad()` on the model never races the update.
        self.resident: list[tuple[str, torch.nn.Parameter, torch.Tensor]] = []
        for name, p in handle.resident_parameters():
            direct = p.device.type == "cpu" and p.dtype == torch.float32
            master = handle.resident_fp32.get(name)  # Note: [A bf16 compute copy of an fp32 model] in hooks.py
            if master is None:
                master = p.detach() if direct else p.detach().to("cpu", torch.float32).clone()
            self.resident.append((name, p, master))
        self._aliased = {id(m) for _, p, m in self.resident if m.data_ptr() == p.data_ptr()}
        self._resident_names = [name for name, _, _ in self.resident]
        # Note: [The compute copy is written in the fused pass]: per layer, its bf16 compute views (or None)
        self._outs: dict[int, list[torch.Tensor] | None] = {}
        for i, entries in self.layers.items():
            ls = handle.store.layers[i]
            fused = not ls.aliased and all(e.dtype == torch.bfloat16 for e in ls.trainable_entries)
            self._outs[i] = [ls.compute_views[name] for name, _, _ in entries] if fused else None
        # units whose state is on NVMe: updated out of core (Note: [The out-of-core optimizer step is chunked] in
        # streaming/nvmestate.py), their masters here are placeholders the optimizer never touches
        self.nvme_state = getattr(handle, "nvme_state", None)
        self._spilled = set(self.nvme_state.units) if self.nvme_state is not None else set()
        self._commits = self.nvme_state.step if self.nvme_state is not None else 0
        self._events = {i: threading.Event() for i in self._order}
        self._resident_done = threading.Event()
        for ev in [*self._events.values(), self._resident_done]:
            ev.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._where: dict[int, tuple[int, int]] = {}
        # LAZYTRAIN_SIMULATE_ASYNC=1: the background update lags by seeded random delays (lazytrain_hf.streams)
        self._delay = SimDelay("optimizer") if overlap and simulate_async() else None
        # Note: [Resident gradients cross asynchronously]: per resident parameter, (staging in its dtype, fp32 grad,
        # the staging's registered block)
        self._res_bufs: dict[str, tuple[torch.Tensor, torch.Tensor, pinned.PinnedBlock]] = {}
        # Note: [Resident parameters are uploaded from pinned staging]: per resident parameter, its staging buffer
        # in the parameter's dtype, the event of the last upload from it and the buffer's registered block
        self._up_bufs: dict[str, list] = {}
        self._uploads: list = []
        self._compute_ev = None  # the training thread's compute event of the last `run()`  # events of the last run's resident uploads (the compute side waits for them)
        handle.fetch_guard = self.wait_layer
        handle.fetch_ready = self.layer_updated  # Note: [A prefetch never waits for the optimizer] (scheduler.py)
        handle.resident_guard = self.wait_resident

    def named_masters(self) -> list[tuple[str, torch.Tensor]]:
        out = [(name, master) for name, _, master in self.resident]
        for entries in self.layers.values():
            out.extend((name, master) for name, master, _ in entries)
        return out

    def master_values(self) -> dict[str, torch.Tensor]:
        """The fp32 masters by name, as values: `named_masters` for those in RAM, copies read from the committed state
        for units whose state is on NVMe (their masters in `named_masters` are placeholders)."""
        out = {}
        for name, master in self.named_masters():
            out[name] = master
        for i in self._spilled:
            for name, master, _ in self.layers.get(i, []):
                out[name] = self.nvme_state.read_param(i, name, "master").view(master.shape)
        return out

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._where = {
            id(p): (gi, k) for gi, g in enumerate(optimizer.param_groups) for k, p in enumerate(g["params"])
        }
        if self.nvme_state is not None:
            self.nvme_state.check_optimizer(
                optimizer,
                self._where,
                {i: [m for _, m, _ in self.layers[i]] for i in self._spilled if i in self.layers},
            )

    # ------------------------------------------------------------------ running
    def run(self, clip_coef: float | None) -> None:
        self.wait_all()
        self.handle.synchronize()  # Note: [Update before fetch]: the host accumulators are complete
        self.handle.mark_resident_released()
        # the optimizer thread's current stream is not the training thread's: its uploads are ordered after this
        # event, recorded here on the training thread (Note: [Backward runs on another thread] in threads.py)
        lanes = self.handle.engine.lanes
        self._compute_ev = lanes.compute_event() if lanes is not None else None
        opt = self.optimizer
        frozen = [{k: v for k, v in g.items()} for g in opt.param_groups]
        trace = self.handle.trace
        step = trace.step_index  # this update's transfers belong to the step that produced the gradients
        # take the gradients over now (Note: [Update before fetch])
        resident = []
        for name, p, master in self.resident:
            g = p.grad
            pending = None
            if g is not None and id(master) in self._aliased:
                master.grad = g  # the model's `.grad` may be cleared now: the alias keeps the tensor
            elif g is None:
                master.grad = None
            else:
                trace.transfer("d2h", g.numel() * g.element_size(), g.dtype, None, "grad")
                pending = self._resident_grad_d2h(name, g, master)  # Note: [Resident gradients cross asynchronously]
            resident.append((p, master, pending))
        layers = []
        for i, entries in self.layers.items():
            fresh = self.handle.store.layers[i].has_grad
            if i in self._spilled:
                # the groups' hyperparameters per tensor; the gradients are read from the unit's file
                layers.append((i, (fresh, [self._where[id(m)][0] for _, m, _ in entries])))
                self._events[i].clear()
                continue
            for _, master, grad in entries:
                master.grad = grad if fresh else None
            layers.append((i, [m for _, m, _ in entries]))
            self._events[i].clear()
        dp = self.data_parallel
        for i in self.remote:
            if dp.from_this_node(i) and not self._plan_resident(i):
                # Note: [The node's compute copy is shared by its ranks]: awaited at its next fetch, not here (a
                # plan-resident unit is never fetched: its slot is refreshed here, in unit order, as before)
                dp.expect_local(i)
                self._local_pending.add(i)
            else:
                layers.append((i, None))  # received from its owner on another node, in unit order
            self._events[i].clear()
        layers.sort(key=lambda item: item[0])  # unit order: every rank's updates and receives pair up
        self._resident_done.clear()
        work = (frozen, resident, layers, clip_coef, step)
        if self.overlap:
            self._thread = threading.Thread(
                target=self._background_work, args=work, name="lazytrain-optimizer", daemon=True
            )
            self._thread.start()
        else:
            self._work(*work)
            self._raise()
            self.handle.wait_uploads()  # the model reads as updated once the step returns
            self._wait_resident_uploads()

    def _resident_grad_d2h(self, name: str, g: torch.Tensor, master: torch.Tensor):
        """Issue the copy of a resident parameter's device gradient to the host; returns what `_take_resident_grad`
        waits for (None when the copy is done). Note: [Resident gradients cross asynchronously]."""
        lanes = self.handle.engine.lanes
        if lanes is None:  # synchronous CPU engine: the copy is the upcast itself
            master.grad = g.detach().to("cpu", torch.float32)
            return None
        bufs = self._res_bufs.get(name)
        if bufs is None or bufs[0].shape != g.shape or bufs[0].dtype != g.dtype:
            # exact-size and registered (Note: [Pinned blocks are registered, not cached] in streaming/store.py)
            block = pinned.PinnedBlock(g.numel() * g.element_size(), True, "resident gradient staging")
            staging = block.tensor.view(g.dtype).view(g.shape)
            host32 = staging if g.dtype == torch.float32 else torch.empty(g.shape, dtype=torch.float32)
            bufs = self._res_bufs[name] = (staging, host32, block)
        staging, host32 = bufs[:2]
        lane = lanes["d2h"]
        lane.hold(g)  # Note: [Gradient memory outlives its D2H copy] in streaming/engine.py
        ev = lane.copy(staging, g.detach(), after_compute=True)
        master.grad = None
        return ev, staging, host32

    def _take_resident_grad(self, master: torch.Tensor, pending) -> None:
        if pending is None:
            return
        ev, staging, host32 = pending
        if on_step_path():
            self.handle.trace.host_sync("resident gradient D2H")  # only without overlap
        ev.synchronize()
        if host32 is not staging:
            host32.copy_(staging)  # upcast on the host: the gradient crossed in its own dtype
        master.grad = host32

    def _upload_resident(self, name: str, p: torch.Tensor, master: torch.Tensor):
        """Copy an updated resident master into its parameter. Note: [Resident parameters are uploaded from pinned
        staging]. Returns the copy's event (None when it is done)."""
        lanes = self.handle.engine.lanes
        if lanes is None:  # synchronous CPU engine
            p.data.copy_(master)
            return None
        entry = self._up_bufs.get(name)
        if entry is None or entry[0].shape != p.shape or entry[0].dtype != p.dtype:
            block = pinned.PinnedBlock(p.numel() * p.element_size(), True, "resident upload staging")
            entry = self._up_bufs[name] = [block.tensor.view(p.dtype).view(p.shape), None, block]
        buf, last = entry[:2]
        if last is not None:
            if on_step_path():
                self.handle.trace.host_sync("resident upload staging")  # only without overlap
            last.synchronize()  # the previous step's upload has read the staging buffer (long done)
        buf.copy_(master)  # the conversion to the compute dtype runs on the host
        # after the compute queued so far (the step's backward, which read the parameter): the next forward only
        # starts once `wait_resident` returned, so nothing of it is queued yet
        ev = lanes["h2d"].copy(p.data, buf, after=(self._compute_ev,))
        entry[1] = ev
        return ev

    def _update(
        self, frozen: list[dict], params: list[torch.Tensor], clip: float | None, outs: list | None = None
    ) -> bool:
        """One fused pass per tensor; ``outs`` (one bf16 view per tensor) receive the compute copy. Returns whether
        every tensor's compute copy was written (all had a gradient)."""
        opt = self.optimizer
        if self._delay is not None:
            self._delay.sleep()
        written = outs is not None
        for k, p in enumerate(params):
            if p.grad is None:
                written = False
                continue
            gi, j = self._where[id(p)]
            opt._update(p, frozen[gi], j, 1.0 if clip is None else float(clip), None if outs is None else outs[k])
        return written

    def _background_work(self, *work) -> None:
        with background_worker():  # its host waits do not stall the step
            self._work(*work)

    def _work(self, frozen, resident, layers, clip, step) -> None:
        trace = self.handle.trace
        clock = trace.clock
        try:
            with torch.no_grad(), trace.in_step(step):
                t0 = clock()
                for _, master, pending in resident:
                    self._take_resident_grad(master, pending)  # Note: [Resident gradients cross asynchronously]
                self._update(frozen, [m for _, m, _ in resident], clip)
                uploads = []
                for name, (p, master, _) in zip(self._resident_names, resident):
                    if id(master) not in self._aliased:
                        if master.grad is not None:
                            trace.transfer("h2d", p.numel() * p.element_size(), p.dtype, None, "upload")
                        ev = self._upload_resident(name, p, master)
                        if ev is not None:
                            uploads.append(ev)
                    master.grad = None
                self._uploads = uploads
                trace.update("resident", t0, clock())
                self._resident_done.set()
                dp = self.data_parallel
                for i, params in layers:
                    t0 = clock()
                    if params is None:
                        # Note: [The node's compute copy is shared by its ranks]
                        dp.receive_compute(self.handle, i, step)
                        self._events[i].set()
                        continue
                    if i in self._spilled:
                        fresh, gis = params
                        if fresh:
                            self.nvme_state.update_unit(
                                i,
                                [frozen[gi] for gi in gis],
                                self.optimizer.backend,
                                1.0 if clip is None else float(clip),
                                step,
                            )
                        else:
                            self.nvme_state.skip_unit(i)
                        trace.update(i, t0, clock())
                        self._events[i].set()
                        if dp is not None:
                            dp.send_compute(self.handle, i)
                        continue
                    outs = self._outs[i]
                    if outs is not None:
                        self.handle.engine.wait_host_reads(i)  # Note: [The compute copy is written in the fused pass]
                    written = self._update(frozen, params, clip, outs)
                    for m in params:
                        m.grad = None
                    self.handle.sync_compute(i, compute_written=written)
                    trace.update(i, t0, clock())
                    self._events[i].set()
                    if dp is not None:
                        dp.send_compute(self.handle, i)
                if self.nvme_state is not None:
                    # Note: [The state on NVMe commits per optimizer step]
                    self._commits += 1
                    self.nvme_state.commit(self._commits)
        except BaseException as e:  # surfaced to the training thread by the next wait
            self._error = e
        finally:
            self._resident_done.set()
            for ev in self._events.values():
                ev.set()

    # ------------------------------------------------------------------ waiting
    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("the layer-wise optimizer step failed") from err

    def layer_updated(self, i: int) -> bool:
        """Whether layer ``i``'s update of the last `run()` is done (never blocks): a prefetch of the layer may read
        its host compute copy now. Note: [A prefetch never waits for the optimizer] in streaming/scheduler.py."""
        if i in self._local_pending:
            if not self.data_parallel.local_updated(i):
                return False
            self._await_local(i)  # published: returns at once
        ev = self._events.get(i)
        return ev is None or ev.is_set()

    def _plan_resident(self, i: int) -> bool:
        layers = self.handle.plan.layers
        return 0 <= i < len(layers) and bool(layers[i].resident)

    def _await_local(self, i: int) -> None:
        """Note: [The node's compute copy is shared by its ranks] (training/dataparallel.py): this step's version
        of unit ``i`` from its owner on this node."""
        self.data_parallel.await_local(self.handle, i)
        self._local_pending.discard(i)
        self._events[i].set()

    def wait_layer(self, i: int) -> None:
        if i in self._local_pending:
            self._await_local(i)
        ev = self._events.get(i)
        if ev is not None:
            ev.wait()
        self._raise()

    def wait_resident(self) -> None:
        self._resident_done.wait()
        self._raise()
        self._wait_resident_uploads()

    def _wait_resident_uploads(self) -> None:
        """The compute side waits for the resident parameters' uploads (Note: [Resident parameters are uploaded from
        pinned staging]); the host does not."""
        lanes = self.handle.engine.lanes
        uploads, self._uploads = self._uploads, []
        if lanes is not None:
            for ev in uploads:
                lanes.compute_wait(ev)

    def wait_all(self) -> None:
        for i in sorted(self._local_pending):
            self._await_local(i)
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._raise()
            self.handle.wait_uploads()
        self._raise()
        self._wait_resident_uploads()

    def close(self) -> None:
        try:
            self.wait_all()
        finally:
            self.handle.fetch_guard = None
            self.handle.fetch_ready = None
            self.handle.resident_guard = None
