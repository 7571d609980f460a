"""Tier backends: where one saved tensor lives between its layer's forward and backward.

Every tier has the same interface, used by the router (`engine.py`) and the recomputer (`recompute.py`):

- ``store(layer, t, layout) -> Entry``: take the tensor over (keep it, or start its copy off the device);
- ``prefetch(entry)``: issue its reload now, so the copy overlaps compute (a no-op where nothing moves);
- ``materialize(entry) -> Tensor``: the device tensor, waiting for the reload (issued on demand if it was not);
- ``release(entry)``: give back everything the entry holds. Idempotent.

`DeviceTier` (``gpu``) keeps the tensor; `HostTier` (``cpu``) copies it into a pooled (pinned) host buffer on the
D2H lane and back on the H2D lane; `NvmeTier` (``nvme``, in `nvme.py`) stages through a host buffer and writes a
spill file. The tiers share a `TierContext` (device, lanes, accountant, pool, in-flight offload sources). This module
owns no policy: which tier a tensor goes to is the router's decision, from the plan.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch

from .. import streams, threads
from .accounting import Accountant
from .layout import Layout
from .pool import HostBufferPool

HOST_LEAD_ENV = "LAZYTRAIN_SIMULATE_HOST_LEAD"


def simulated_host_lead() -> int:
    """``LAZYTRAIN_SIMULATE_HOST_LEAD``: how many layers the simulated host runs ahead of the device (default 0; Note:
    [The host leads the device by two stages])."""
    raw = os.environ.get(HOST_LEAD_ENV, "0")
    try:
        value = int(raw)
    except ValueError as e:
        raise ValueError(f"{HOST_LEAD_ENV}={raw!r} must be a number of layers (e.g. 8).") from e
    if value < 0:
        raise ValueError(f"{HOST_LEAD_ENV}={raw!r} must be >= 0.")
    return value


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align if align > 1 else n


def aligned(buf: torch.Tensor, nbytes: int, align: int) -> torch.Tensor:
    """The ``round_up(nbytes, align)`` bytes of the uint8 buffer ``buf`` that start at an address aligned to
    ``align`` (``buf`` must hold ``round_up(nbytes, align) + align`` bytes); ``buf`` itself when ``align <= 1``."""
    if align <= 1:
        return buf
    pad = (-buf.data_ptr()) % align
    out = buf[pad : pad + round_up(nbytes, align)]
    if out.numel() < round_up(nbytes, align):
        raise ValueError(f"a buffer of {buf.numel()} bytes holds no {align}-aligned region of {nbytes} bytes.")
    return out


class Entry:
    """One stored saved tensor (or recompute input) of a layer, on the tier its layer plan names."""

    __slots__ = (
        "layer",
        "tier",
        "layout",
        "holders",
        "released",
        "tensor",
        "acct_key",
        "host",
        "copy_event",
        "file",
        "offset",
        "write_future",
        "reloaded",
        "reload_key",
        "reload_event",
        "reload_waited",
        "reload_future",
        "reload_stream",
        "__weakref__",
    )

    def __init__(self, layer: int, tier: str, layout: Layout | None) -> None:
        self.layer, self.tier, self.layout = layer, tier, layout
        self.holders = 0
        self.released = False
        self.tensor: torch.Tensor | None = None  # gpu tier: the tensor itself
        self.acct_key: int | None = None
        self.host: torch.Tensor | None = None  # cpu tier: the pool buffer
        self.copy_event: Any = None  # asynchronous engines: the D2H copy into `host` / the staging buffer
        self.file: Any = None  # nvme tier: its spill file
        self.offset = 0
        self.write_future: Future | None = None
        self.reloaded: torch.Tensor | None = None  # the device tensor handed to autograd
        self.reload_key: int | None = None
        self.reload_event: Any = None
        self.reload_waited = False  # the compute side waited for `reload_event` (Note: [Released reloads ...])
        self.reload_future: Future | None = None
        self.reload_stream: Any = None


class TierContext:
    """What the tiers of one engine share.

    Args:
        device: the compute device.
        lanes: the copy lanes (`lazytrain_hf.streams`); ``None`` for synchronous CPU copies.
        pin_memory: pin the host buffer pool.
    """

    def __init__(self, device: torch.device, lanes: streams.Lanes | None, pin_memory: bool) -> None:
        self.device = device
        self.lanes = lanes
        self.is_async = lanes is not None
        self.acct = Accountant()
        # the simulated asynchronous engine poisons buffers handed back (Note: [Simulated copies poison ...])
        self.pool = HostBufferPool(pin_memory=pin_memory, poison=self.is_async and device.type == "cpu")
        # (event, source, acct key, layer) of offload copies whose source still counts as device bytes
        self.inflight: deque[tuple[Any, torch.Tensor, int | None, int]] = deque()
        # Note: [The host leads the device by two stages]: the simulated lead (0: none), the latest layer that
        # offloaded (the host's position) and the latest one whose offload copies the host waited for
        self.host_lead = simulated_host_lead() if self.is_async and device.type == "cpu" else 0
        self.host_stage = -1
        self.caught_up = -1
        self.layer_bytes: dict[int, dict[str, int]] = {}
        self.trace: Any = None  # the executor's `Trace` (lazytrain_hf.streaming.trace), when attached to one
        self.offload_events: dict[int, Any] = {}  # layer -> its last D2H offload copy (one lane: FIFO)

    def record(self, lane: str, nbytes: int, dtype: Any, layer: int | None, what: str) -> None:
        if self.trace is not None:
            self.trace.transfer(lane, nbytes, dtype, layer, what)

    def host_sync(self, reason: str) -> None:
        # counted on the training thread and on the autograd thread that runs its backward, not on background
        # workers (Note: [Backward runs on another thread] in lazytrain_hf/threads.py)
        if self.trace is not None and threads.on_step_path():
            self.trace.host_sync(reason)

    def count_layer(self, layer: int, tier: str, n: int) -> None:
        d = self.layer_bytes.setdefault(layer, {"gpu": 0, "cpu": 0, "nvme": 0})
        d[tier] += n

    def poll_inflight(self) -> None:
        """Offload sources whose D2H copy completed stop counting as device bytes (with a simulated host lead: once
        the device is known to have passed their copy, Note: [The host leads the device by two stages])."""
        while self.inflight and self.inflight[0][0].query() and self._device_passed(self.inflight[0][3]):
            _, _, key, _ = self.inflight.popleft()
            self.acct.remove_storage(key)

    def _device_passed(self, layer: int) -> bool:
        lead = self.host_lead
        return lead == 0 or layer <= self.caught_up or self.host_stage - layer >= lead

    def bound_host_lead(self, layer: int, ev: Any) -> None:
        """Note: [The host leads the device by two stages]
        On CUDA nothing in a forward blocks the host: it queues layer after layer, each kernel claiming its memory
        at launch, while an offload source is freed only once the host sees its D2H copy complete. A host running
        ``K`` layers ahead of the device thus holds ``K`` layers of offload sources (and a plan that offloads
        approaches keep-all's peak); the device-side wait of Note: [Two stages of copies in flight]
        (streaming/engine.py) does not bound that. So the forward of layer ``i`` also waits on the host for the
        offload copies of layer ``i - 2`` (``layer``; a host sync only when they have not landed yet) and drops
        their sources: the sources of at most layers ``i - 1`` and ``i`` are on the device, what the planner's stage
        model charges (a copy issued after stage ``s`` occupies stage ``s + 1``).

        The simulation's compute is synchronous, so its host never leads; ``LAZYTRAIN_SIMULATE_HOST_LEAD=K``
        imitates a host ``K`` layers ahead: an offload source stays on the device (counted) until the host is ``K``
        layers past it or waited for its copy here. Test:
        ``tests/test_cuda_semantics_host.py::test_host_lead_is_bounded``."""
        if not ev.query():
            self.host_sync("the host waits for the offload copies of two layers back (its lead over the device)")
            ev.synchronize()
        self.caught_up = max(self.caught_up, layer)
        self.poll_inflight()

    def drain_inflight(self) -> None:
        """Drop the offload sources at the end of a step without blocking the host.

        Note: [Offload sources are dropped behind their copy]
            A source whose D2H copy has not finished (a tensor offloaded and then freed by its graph before
            backward, so no reload waited for it) is released after the compute stream waits for the copy's
            event: its memory came from the compute stream, so the caching allocator hands it out again only to
            work queued after that wait. In the simulation the wait is a host wait, as every compute wait there.
        """
        self.host_stage = self.caught_up = -1
        while self.inflight:
            ev, _, key, _ = self.inflight.popleft()
            if not ev.query() and self.lanes is not None:
                self.lanes.compute_wait(ev)
            self.acct.remove_storage(key)


class Tier:
    """The interface (see the module docstring) and what the moving tiers share: reload storage, release."""

    name = ""

    def __init__(self, ctx: TierContext) -> None:
        self.ctx = ctx

    def store(self, layer: int, t: torch.Tensor, layout: Layout | None) -> Entry:
        raise NotImplementedError

    def prefetch(self, entry: Entry) -> None:
        new = self._new_reload(entry)
        if new is not None:
            self._issue_reload(entry, *new)

    def _issue_reload(self, entry: Entry, storage: torch.Tensor, narrow: torch.Tensor) -> None:
        """Start the copy back into the fresh device ``storage`` (``narrow``: the view the copy writes)."""
        raise NotImplementedError

    def materialize(self, entry: Entry) -> torch.Tensor:
        raise NotImplementedError

    def release(self, entry: Entry) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared by the cpu and nvme tiers
    @staticmethod
    def _released_error(entry: Entry) -> RuntimeError:
        return RuntimeError(
            f"a saved activation of layer {entry.layer} was released by end_step() before backward used it; "
            "call end_step() only after backward."
        )

    def _new_reload(self, entry: Entry) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Allocate the device storage of a reload (under the accountant's lock); None if already issued."""
        ctx = self.ctx
        with ctx.acct.lock:
            if entry.released or entry.reloaded is not None:
                return None
            storage, narrow, final = entry.layout.empty(ctx.device)
            entry.reloaded = final
            entry.reload_key, _ = ctx.acct.add_storage(final)
        if ctx.device.type == "cuda":
            entry.reload_stream = torch.cuda.current_stream(ctx.device)
        return storage, narrow

    def _wait_reload(self, entry: Entry) -> torch.Tensor:
        """The reloaded tensor once the compute side may read it."""
        ctx = self.ctx
        out = entry.reloaded
        if ctx.trace is not None:
            ctx.trace.waited(entry.layer, "reload")
        if ctx.is_async:
            ctx.lanes.compute_wait(entry.reload_event)
            entry.reload_waited = True
        if ctx.device.type == "cuda":
            cur = torch.cuda.current_stream(ctx.device)
            if entry.reload_stream is not None and entry.reload_stream != cur:
                out.record_stream(cur)  # allocated on another stream than the one that frees it
        return out

    def _copy_off_device(
        self, layer: int, t: torch.Tensor, layout: Layout, align: int = 0
    ) -> tuple[Entry, torch.Tensor, torch.Tensor]:
        """Copy ``t`` into a pool buffer (the D2H lane when asynchronous): the cpu tier's store and the nvme tier's
        staging. Returns the entry, the pool buffer and the region of it that holds the bytes (starting at an
        ``align``-aligned address, `aligned`; the buffer itself when ``align`` is 0)."""
        ctx = self.ctx
        entry = Entry(layer, self.name, layout)
        nbytes = layout.nbytes
        buf = ctx.pool.get(round_up(nbytes, align) + align if align > 1 else nbytes)
        region = aligned(buf, nbytes, align)
        host = layout.host_view(region)
        src = layout.source(t)
        ctx.record("d2h", nbytes, t.dtype, layer, "offload")
        if ctx.is_async:
            # Note: [D2H waits for the producer]
            # The side stream must not read the activation before the compute stream has written it.
            ev = ctx.lanes["d2h"].copy(host, src, after_compute=True)
            # Note: [Offload source stays alive until its copy completes]
            # Autograd drops its reference to `t` now (it holds our `Saved`); the caching allocator could hand the
            # block to the next kernel while the D2H copy still reads it. The source is held in `inflight` until
            # its event completes (polled at every pack / end_layer), instead of record_stream, whose deferred
            # frees fragment the allocator. It counts as device bytes until then.
            key, _ = ctx.acct.add_storage(t)
            ctx.inflight.append((ev, t, key, layer))
            ctx.host_stage = max(ctx.host_stage, layer)  # Note: [The host leads the device by two stages]
            entry.copy_event = ev
            ctx.offload_events[layer] = ev  # Note: [Two stages of copies in flight] (streaming/engine.py)
        else:
            host.copy_(src)
        ctx.acct.add("cpu", nbytes)
        ctx.count_layer(layer, self.name, nbytes)
        return entry, buf, region

    def _release_reload(self, entry: Entry) -> bool:
        """The release steps every tier shares; False when the entry was released already.

        Note: [Released reloads free behind their copy]
        Releasing a reloaded entry (from `Saved.__del__` on the autograd thread, or at `end_step`) drops the device
        storage the H2D copy wrote; the caching allocator may hand that block to the next kernel of the stream it
        was allocated on (`Entry.reload_stream`, the compute stream). No host wait is needed for that:

        - when the compute side consumed the reload (`_wait_reload`, ``reload_waited``), its stream already waits
          for the copy's event, so every later kernel of that stream runs after the copy (and a consumer on another
          stream holds the block through ``record_stream``);
        - when it did not (released before backward unpacked it), the allocation stream is made to wait for the
          copy's event here (``reload_stream.wait_event``): a device-side wait, not a host one;
        - the host buffer the copy read is safe already: the pool carries the copy's event (Note: [Pool buffers
          carry their last copy]); a simulated copy's closure holds its tensors until it ran.

        Only an NVMe read still in flight on a reader thread blocks (the thread writes into the storage and returns
        the event): counted as a host sync.
        """
        ctx = self.ctx
        acct = ctx.acct
        with acct.lock:
            if entry.released:
                return False
            entry.released = True
            entry.tensor = None
            if entry.acct_key is not None:
                acct.remove_storage(entry.acct_key)
                entry.acct_key = None
            fut = entry.reload_future
        ev = entry.reload_event
        if fut is not None:
            ctx.host_sync("activations: a reload released before use waits for its NVMe read")
            try:
                ev = fut.result()  # the reader writes into `reloaded`: let it finish before dropping it
            except Exception:
                ev = None  # the read failed: no copy was issued
        if ev is not None and not entry.reload_waited and entry.reload_stream is not None:
            entry.reload_stream.wait_event(ev)  # See Note: [Released reloads free behind their copy]
        with acct.lock:
            entry.reloaded = None
            entry.reload_future = None
            if entry.reload_key is not None:
                acct.remove_storage(entry.reload_key)
                entry.reload_key = None
        return True


class DeviceTier(Tier):
    """``gpu``: the tensor stays where it is, counted as device bytes until released."""

    name = "gpu"

    def store(self, layer: int, t: torch.Tensor, layout: Layout | None = None) -> Entry:
        ctx = self.ctx
        entry = Entry(layer, self.name, None)
        entry.tensor = t
        entry.acct_key, n = ctx.acct.add_storage(t)
        ctx.count_layer(layer, self.name, n)
        return entry

    def prefetch(self, entry: Entry) -> None:
        return None

    def materialize(self, entry: Entry) -> torch.Tensor:
        if entry.tensor is None:
            raise self._released_error(entry)
        return entry.tensor

    def release(self, entry: Entry) -> None:
        self._release_reload(entry)


class HostTier(Tier):
    """``cpu``: a pooled host buffer (pinned on CUDA), filled on the D2H lane and reloaded on the H2D lane."""

    name = "cpu"

    def store(self, layer: int, t: torch.Tensor, layout: Layout) -> Entry:
        entry, buf, _ = self._copy_off_device(layer, t, layout)
        entry.host = buf
        return entry

    def _issue_reload(self, entry: Entry, storage: torch.Tensor, narrow: torch.Tensor) -> None:
        ctx = self.ctx
        src = entry.layout.host_view(entry.host)
        ctx.record("h2d", entry.layout.nbytes, src.dtype, entry.layer, "reload")
        if ctx.is_async:
            # Note: [H2D waits for the block's previous users]
            # `storage` was allocated on the current stream, whose earlier kernels may still use the block it
            # reuses; the side stream writes only after them. Note: [Reload waits for the offload copy]: and
            # only after the D2H copy that filled the host buffer.
            entry.reload_event = ctx.lanes["h2d"].copy(narrow, src, after=(entry.copy_event,), after_compute=True)
        else:
            narrow.copy_(src)

    def materialize(self, entry: Entry) -> torch.Tensor:
        if entry.released:
            raise self._released_error(entry)
        self.prefetch(entry)
        return self._wait_reload(entry)

    def release(self, entry: Entry) -> None:
        if not self._release_reload(entry):
            return
        ctx = self.ctx
        with ctx.acct.lock:
            if entry.host is not None:
                # the H2D copy of a reload may still read it; See Note: [Pool buffers carry their last copy]
                ctx.pool.put(entry.host, entry.reload_event or entry.copy_event)
                entry.host = None
                ctx.acct.add("cpu", -entry.layout.nbytes)
