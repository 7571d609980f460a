"""CUDA's host-memory rules as the simulated engine imitates them (lazytrain_hf/pinned.py, lazytrain_hf/streams.py), and
the executor obeying them: registered ranges, pinned lane copies, weakly held copy sources, exact pinned accounting,
the state on NVMe's windows and write-back order."""

from __future__ import annotations

import gc
import time

import pytest
import torch
from conftest import offload_step_device_bytes, tiny_model

from lazytrain_hf import pinned, streams
from lazytrain_hf.planner.plan import Plan
from lazytrain_hf.streaming import attach
from lazytrain_hf.streaming import engine as streaming_engine


@pytest.fixture
def sim(monkeypatch):
    monkeypatch.setenv("LAZYTRAIN_SIMULATE_ASYNC", "1")


# ---------------------------------------------------------------------------------------------- the registry itself
def test_registry_refuses_overlaps_and_reports_buffers_freed_while_registered(sim):
    """Overlapping registrations fail with 712, disjoint ranges on one page do not (as the driver), and a registered
    buffer freed before it was unregistered is reported by the next registry call."""
    reg = pinned.REGISTRY
    base = torch.zeros(4096, dtype=torch.uint8)
    a = reg.register(base[:100], "a")
    b = reg.register(base[100:200], "b")  # same page, disjoint bytes: allowed
    with pytest.raises(pinned.HostRegisterError, match="712.*registered for [ab]"):
        reg.register(base[50:150], "c")
    reg.unregister(a)
    reg.unregister(b)
    t = torch.zeros(1000)
    reg.register(t, "the freed one")
    del t
    with pytest.raises(pinned.HostRegisterError, match="the freed one was freed while still registered"):
        reg.check(reset=True)
    keep: list = []
    x = pinned.pinned_empty(300, torch.float32, True, keep, "a block")
    assert reg.is_pinned(x[10:20]) and x.data_ptr() % pinned.PAGE == 0 and torch.equal(x, torch.zeros(300))
    assert not reg.is_pinned(torch.zeros(300))
    before = reg.registered_bytes
    keep.clear()  # released: unregistered first, then freed (no violation)
    assert reg.registered_bytes == before - 1200
    reg.check()


def test_caching_host_allocator_rounds_up_and_keeps():
    """Note: [The caching host allocator rounds and keeps]: a block is accounted at its power of two, a freed block is
    kept and reused for the same size class, never returned."""
    reg = pinned.REGISTRY
    c0 = reg.cached_bytes
    t = pinned.cached_empty(300, torch.float32)  # 1200 B -> 2048 B
    assert reg.cached_bytes - c0 == 2048 and reg.is_pinned(t)
    del t
    u = pinned.cached_empty(257, torch.float32)  # same size class: reused
    assert reg.cached_bytes - c0 == 2048
    del u


# ------------------------------------------------------------------------------------------------- the lanes
def test_lane_copies_need_pinned_host_memory(sim):
    """Note: [Simulated copies need pinned host memory]: the host side of an h2d / d2h copy must be pinned."""
    lanes = streams.Lanes(torch.device("cpu"), ("h2d", "d2h"), "test")
    try:
        keep: list = []
        host = pinned.pinned_empty(64, torch.float32, True, keep)
        dev = torch.arange(64.0)
        lanes["d2h"].copy(host, dev).synchronize()
        assert torch.equal(host, dev)
        with pytest.raises(pinned.PageableCopyError, match="d2h copy"):
            lanes["d2h"].copy(torch.empty(64), dev)
        with pytest.raises(pinned.PageableCopyError, match="h2d copy"):
            lanes["h2d"].copy(torch.empty(64), torch.ones(64))
        lanes["h2d"].copy(dev, host).synchronize()
    finally:
        lanes.close()


def test_lane_copy_sources_are_held_weakly(sim):
    """Note: [Simulated copies hold their sources weakly]: a source dropped before its copy ran raises; one passed to
    `hold` (record_stream) is kept until the copy ran."""
    lanes = streams.Lanes(torch.device("cpu"), ("d2h",), "test")
    lane = lanes["d2h"]
    try:
        keep: list = []
        host = pinned.pinned_empty(64, torch.float32, True, keep)
        gate = streams.SimEvent()
        src = torch.arange(64.0)
        ev = lane.copy(host, src, after=(gate,))
        del src  # freed before the copy ran
        gate._finish()
        with pytest.raises(RuntimeError, match="simulated asynchronous copy failed"):
            ev.synchronize()
        gate = streams.SimEvent()
        src = torch.arange(64.0)
        lane.hold(src)
        ev = lane.copy(host, src, after=(gate,))
        del src
        gate._finish()
        ev.synchronize()
        assert torch.equal(host, torch.arange(64.0))
    finally:
        lanes.close()


# ---------------------------------------------------------------------------------------------- the executor
def _batch(model, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (2, 12), generator=g)


def _grads(
    tmp_path, state_nvme: list[int], ga: int, prefetch_depth: int = 1, seen: dict | None = None, **model_kw
) -> dict[str, torch.Tensor]:
    """Host gradients after ``ga`` micro-batches (accumulated) with the given units' state on NVMe; ``seen`` gets the
    step's host syncs (before the gradients are read) and the most fetch windows allocated at once."""
    model = tiny_model("qwen3", **model_kw)
    L = model.config.num_hidden_layers
    plan = Plan.default(L, micro_batch_size=2, seq_len=12, state_nvme=state_nvme, prefetch_depth=prefetch_depth)
    handle = attach(model, plan, "cpu", state_nvme_dir=str(tmp_path) if state_nvme else None)
    try:
        handle.zero_grad()
        for k in range(ga):
            handle.last_micro_batch = k == ga - 1
            ids = _batch(model, k)
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        if seen is not None:
            seen["sync_reasons"] = dict(handle.trace.current["sync_reasons"])
            if handle.nvme_state is not None:
                seen["fetch_windows"] = handle.nvme_state.fetch_windows.most_allocated
        return {n: g.clone() for n, g in handle.grads().items()}
    finally:
        handle.remove()


def test_state_nvme_units_unregister_before_their_buffers_go(sim, tmp_path):
    """Defect: a unit whose state moves to NVMe had its registered (page-locked) store buffers freed while still
    registered (pages left locked; the next unit's buffer at that address fails cudaHostRegister with 712). Now no
    registration outlives its buffer, and no store buffer of such a unit stays registered."""
    model = tiny_model("qwen3")
    L = model.config.num_hidden_layers
    plan = Plan.default(L, micro_batch_size=2, seq_len=12, state_nvme=list(range(L)))
    before = pinned.REGISTRY.registered_bytes
    handle = attach(model, plan, "cpu", state_nvme_dir=str(tmp_path))
    try:
        pinned.REGISTRY.check()
        store = [r for r in pinned.REGISTRY._ranges.values() if "store" in r.what]
        assert store == [], store
        assert pinned.REGISTRY.registered_bytes - before <= handle.nvme_state.window_bytes()
    finally:
        handle.remove()
    pinned.REGISTRY.check()


def test_state_nvme_windows_are_pinned(sim, tmp_path):
    """Defect: the state on NVMe's fetch and gradient windows were pageable, so the "asynchronous" copies into and out
    of them were synchronous on CUDA. Under the simulation a pageable lane copy raises; the gradients equal the state
    in RAM bit for bit."""
    ram = _grads(tmp_path / "ram", [], 1)
    disk = _grads(tmp_path, [0, 1, 2, 3], 1)
    assert ram.keys() == disk.keys()
    for n in ram:
        assert torch.equal(ram[n], disk[n]), n


def test_state_nvme_write_back_precedes_the_next_micro_batch(sim, tmp_path, monkeypatch):
    """Defect: with the state on NVMe and gradient accumulation nothing ordered micro-batch k+1's `open_grad`
    (reading the accumulated gradient) after micro-batch k's write-back on the host worker. With every worker job
    delayed 0.5 s the worker wrote into the next micro-batch's window (or a poisoned view). Gradients now equal the
    state in RAM bit for bit."""
    submit = streaming_engine._HostWorker.submit

    def slow(self, fn):
        def late() -> None:
            time.sleep(0.5)
            fn()

        submit(self, late)

    monkeypatch.setattr(streaming_engine._HostWorker, "submit", slow)
    ram = _grads(tmp_path / "ram", [], 2)
    disk = _grads(tmp_path, [0, 1, 2, 3], 2)
    for n in ram:
        assert torch.equal(ram[n], disk[n]), n


def test_pinned_buffers_are_registered_at_their_exact_size(sim, tmp_path):
    """Defect: the activation pool and gradient staging took their pinned memory from the caching host allocator,
    rounded to powers of two and never returned (up to 2x the plan). Now nothing comes from it, and the registered
    bytes are exactly what the pools and the store hold."""
    from lazytrain_hf.planner.plan import LayerPlan

    model = tiny_model("qwen3", hidden_size=40, intermediate_size=72)  # sizes that are not powers of two
    L = model.config.num_hidden_layers
    layers = [LayerPlan(index=i, kind="full_attention", policy="offload_cpu") for i in range(L)]
    plan = Plan(layers=layers, micro_batch_size=2, seq_len=12)
    gc.collect()
    c0, r0 = pinned.REGISTRY.cached_bytes, pinned.REGISTRY.registered_bytes
    handle = attach(model, plan, "cpu")
    try:
        handle.zero_grad()
        for k in range(2):  # gradient accumulation: the second micro-batch crosses through staging
            handle.last_micro_batch = k == 1
            ids = _batch(model, k)
            model(input_ids=ids, labels=ids).loss.backward()
        handle.synchronize()
        assert pinned.REGISTRY.cached_bytes == c0, "pinned memory from the caching host allocator"
        store = sum(ls.compute_bytes.numel() + ls.grad.numel() * 4 for ls in handle.store.layers.values())
        held = store + handle.activations.pool.allocated_bytes + handle.engine._staging.allocated_bytes
        assert handle.activations.pool.allocated_bytes > 0 and handle.engine._staging.allocated_bytes > 0
        assert pinned.REGISTRY.registered_bytes - r0 == held
    finally:
        handle.remove()
    del handle, model
    gc.collect()
    assert pinned.REGISTRY.registered_bytes == r0  # everything unregistered once the handle is gone


@pytest.mark.parametrize("lead", [0, 8])
def test_host_lead_is_bounded(sim, monkeypatch, lead):
    """Note: [The host leads the device by two stages]: with the simulated host running ``lead`` layers ahead of the
    device (8: the whole forward), the offload sources on the device never exceed the layer computing and the one
    before it (plus one being dropped), the memory the planner's stage model charges (``alive(i, i + 1)`` per offload
    source, planner/stages.py), and the step's measured device peak stays within the plan's. Defect: the bound was a
    device-side wait only, so with a lead of 8 every layer's source stayed (peak = keep-all)."""
    from lazytrain_hf.activations.tiers import HOST_LEAD_ENV
    from lazytrain_hf.planner import costmodel

    def check_lead(handle):
        assert handle.activations._tiers.host_lead == lead

    monkeypatch.setenv(HOST_LEAD_ENV, str(lead))
    model, seen, per_layer = offload_step_device_bytes(8, inspect=check_lead)
    assert len(seen) == 8 and per_layer > 0
    # the stage model's charge in forward stage i < L - 1: offload sources of layers i - 1 and i (at the last layer
    # the first backward reload is issued too)
    cm = costmodel.CostModel.from_config(
        model.config, "cpu", seq_len=10, micro_batch_size=2, dtype_bytes=4, attn_implementation="eager"
    )
    charged = 2 * max(lc.saved_bytes for lc in cm.layers)
    assert max(seen[:-1]) <= charged, (lead, [s / charged for s in seen])
    assert max(seen) <= 3 * per_layer, (lead, max(seen) / per_layer, seen)


@pytest.mark.parametrize("ga", [1, 2])
def test_planner_charges_the_gradient_staging(sim, ga):
    """The host footprint charges the pinned gradient staging the engine really holds: a bf16 model stages every
    gradient (bf16 crosses, the fp32 accumulator is written on the host: Note: [Gradients cross in their own dtype]),
    with or without gradient accumulation. Defect: only gradient accumulation was charged (0 bytes for bf16, ga=1)."""
    from lazytrain_hf.planner import hostmem

    model = tiny_model("qwen3", hidden_size=40, intermediate_size=72).to(torch.bfloat16)
    L = model.config.num_hidden_layers
    plan = Plan.default(L, micro_batch_size=2, seq_len=12)
    fp = hostmem.run_footprint(model, plan, device="cuda", gradient_accumulation_steps=ga)
    handle = attach(model, plan, "cpu")
    try:
        handle.zero_grad()
        for k in range(ga):
            handle.last_micro_batch = k == ga - 1
            ids = _batch(model, k)
            model(input_ids=ids, labels=ids).loss.backward()
        handle.synchronize()
        staged = handle.engine._staging.allocated_bytes
    finally:
        handle.remove()
    assert 0 < staged <= fp.staging, (staged, fp.staging)


def _backward_peak(lead: int, monkeypatch) -> tuple[int, int]:
    from lazytrain_hf.activations.tiers import HOST_LEAD_ENV

    monkeypatch.setenv(HOST_LEAD_ENV, str(lead))
    model = tiny_model("qwen3", seed=1, num_hidden_layers=8)
    layer_grad = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    plan = Plan.default(8, micro_batch_size=2, seq_len=10)
    for lp in plan.layers:
        lp.policy = "recompute"  # little saved per layer: the gradients decide the backward's peak
    handle = attach(model, plan=plan)
    try:
        ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
        loss = handle.causal_lm_loss(model, {"input_ids": ids, "labels": ids})
        handle.reset_peak()
        loss.backward()
        return handle.memory_stats()["device_peak_bytes"], layer_grad
    finally:
        handle.remove()


def test_host_lead_is_bounded_in_backward(sim, monkeypatch):
    """Note: [Gradients freed behind their copy stay while the host leads]: with the simulated host 8 layers ahead of
    the device, the backward's measured device peak exceeds the one without a lead by at most one layer's gradients
    (the stage model's ``alive(B_i, B_i + 1)``: a layer's gradients live during its backward stage and the next):
    the host waits for the gradient copies of two layers back. Without that wait every layer's gradients stayed."""
    base, layer_grad = _backward_peak(0, monkeypatch)
    led, _ = _backward_peak(8, monkeypatch)
    assert base <= led <= base + layer_grad, (base, led, (led - base) / layer_grad)


def test_state_nvme_accumulated_gradient_is_read_off_the_training_thread(sim, tmp_path, monkeypatch):
    """Defect (reads on the training thread): with the state on NVMe and gradient accumulation, every micro-batch
    after the first read each unit's accumulated gradient from its file with a synchronous pread on the thread
    driving backward. The read now runs on the host worker, in order before the addition; gradients stay bit-exact
    (``test_state_nvme_write_back_precedes_the_next_micro_batch``)."""
    import threading

    from lazytrain_hf.streaming.nvmestate import NvmeState

    on_training_thread: list[int] = []
    in_backward = [True]  # until the test reads the gradients back (`StreamHandle.grads`: reads on purpose)
    pread, read_grads = NvmeState._pread, NvmeState.read_grads

    def spy(self, u, out, nbytes, offset):
        main = threading.current_thread() is threading.main_thread()
        if in_backward[0] and main and offset == u.grad_off and nbytes == 4 * u.train_elems:
            on_training_thread.append(u.key)
        return pread(self, u, out, nbytes, offset)

    def reading_back(self, key, ls):
        in_backward[0] = False
        return read_grads(self, key, ls)

    monkeypatch.setattr(NvmeState, "_pread", spy)
    monkeypatch.setattr(NvmeState, "read_grads", reading_back)
    _grads(tmp_path, [0, 1, 2, 3], 2)
    assert on_training_thread == []


def _compute_reads(monkeypatch) -> list[tuple[str, bool]]:
    """Record (thread name, whether a wait there stalls the step) of every read of a unit's compute copy from its
    state file until `StreamHandle.remove` reads the units back (on purpose, on the training thread)."""
    import threading

    from lazytrain_hf.streaming.nvmestate import NvmeState
    from lazytrain_hf.threads import on_step_path

    reads: list[tuple[str, bool]] = []
    in_step = [True]
    pread, leave_on_disk = NvmeState._pread, NvmeState.leave_on_disk

    def spy(self, u, out, nbytes, offset):
        if in_step[0] and offset == 0 and nbytes == u.compute_bytes:
            reads.append((threading.current_thread().name, on_step_path()))
        return pread(self, u, out, nbytes, offset)

    def removing(self, key, ls):
        in_step[0] = False
        return leave_on_disk(self, key, ls)

    monkeypatch.setattr(NvmeState, "_pread", spy)
    monkeypatch.setattr(NvmeState, "leave_on_disk", removing)
    return reads


def test_state_nvme_fetch_is_read_off_the_training_thread(sim, tmp_path, monkeypatch):
    """Defect (reads on the training thread): a unit whose state is on NVMe was fetched by a synchronous pread of its
    compute copy on the thread that issues the fetch (the training thread in forward, the autograd thread in
    backward) before its H2D copy was issued, so every prefetch blocked the host for a whole read. The read now runs
    on the state's reader thread, which issues the H2D copy once the read landed; gradients over two micro-batches
    stay bit-exact to the state in RAM."""
    ram = _grads(tmp_path / "ram", [], 2)
    reads = _compute_reads(monkeypatch)
    disk = _grads(tmp_path, [0, 1, 2, 3], 2)
    assert len(reads) >= 2 * 4, reads  # each unit fetched at least once per micro-batch
    on_step = [name for name, stalls in reads if stalls]
    assert on_step == [], f"{len(on_step)} of {len(reads)} fetch reads on the step's threads: {sorted(set(on_step))}"
    for n in ram:
        assert torch.equal(ram[n], disk[n]), n


def test_state_nvme_fetch_windows_are_bounded(sim, tmp_path, monkeypatch):
    """Note: [A fetch from NVMe is read off the step's threads]: with fetches issued three stages ahead and every H2D
    copy stalling for longer than a forward, the reads still go through at most `STATE_FETCH_WINDOWS` fetch windows
    (the host footprint's charge), each reused only once the copy that read it completed: a window refilled earlier
    would hand the slot the next unit's bytes, and the gradients would differ from the state in RAM."""
    from lazytrain_hf.planner.hostmem import STATE_FETCH_WINDOWS

    monkeypatch.setenv("LAZYTRAIN_SIMULATE_ASYNC_STALL_SHARE", "1")
    monkeypatch.setenv("LAZYTRAIN_SIMULATE_ASYNC_STALL_WORKERS", "transfer-h2d")
    ram = _grads(tmp_path / "ram", [], 1, prefetch_depth=3)
    seen: dict = {}
    disk = _grads(tmp_path, [0, 1, 2, 3], 1, prefetch_depth=3, seen=seen)
    for n in ram:
        assert torch.equal(ram[n], disk[n]), n
    assert seen["fetch_windows"] == STATE_FETCH_WINDOWS, seen


def test_state_nvme_fetch_read_stalls_are_waited_for(sim, tmp_path, monkeypatch):
    """The simulation models the read of a fetch from NVMe as a background worker (``state-read``, Note: [Every
    background worker stalls for longer than a forward] in lazytrain_hf/streams.py): with every read stalling, the
    slots are poisoned until read and copy landed, the compute side waits for both (counted as host syncs: the step
    does block when a read is late) and the gradients equal the state in RAM."""
    monkeypatch.setenv("LAZYTRAIN_SIMULATE_ASYNC_STALL_SHARE", "1")
    monkeypatch.setenv("LAZYTRAIN_SIMULATE_ASYNC_STALL_WORKERS", "state-read")
    ram = _grads(tmp_path / "ram", [], 1)
    seen: dict = {}
    disk = _grads(tmp_path, [0, 1, 2, 3], 1, seen=seen)
    for n in ram:
        assert torch.equal(ram[n], disk[n]), n
    assert seen["sync_reasons"].get("a fetch waits for its read from NVMe", 0) > 0, seen


def test_state_nvme_fetch_read_error_reaches_the_step(sim, tmp_path, monkeypatch):
    """A read of a fetch that fails on the reader thread is raised on the step's thread where the compute side waits
    for that fetch (as the read on the training thread raised it), and the handle is removed cleanly afterwards."""
    from lazytrain_hf.streaming.nvmestate import NvmeState
    from lazytrain_hf.streaming.statelayout import StateNvmeError

    model = tiny_model("qwen3")
    L = model.config.num_hidden_layers
    plan = Plan.default(L, micro_batch_size=2, seq_len=12, state_nvme=list(range(L)))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    handle = attach(model, plan, "cpu", state_nvme_dir=str(tmp_path))
    pread = NvmeState._pread

    def failing(self, u, out, nbytes, offset):
        if u.key == 2 and offset == 0 and nbytes == u.compute_bytes:
            raise StateNvmeError(5, "injected read failure")
        return pread(self, u, out, nbytes, offset)

    monkeypatch.setattr(NvmeState, "_pread", failing)
    ids = _batch(model, 0)
    try:
        with pytest.raises(StateNvmeError, match="injected read failure"):
            model(input_ids=ids, labels=ids)
    finally:
        monkeypatch.setattr(NvmeState, "_pread", pread)
        handle.remove()
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)  # no step ran: every weight back as it was


@pytest.mark.parametrize("ga", [1, 2])
def test_state_nvme_gradients_cross_without_host_syncs(sim, tmp_path, monkeypatch, ga):
    """The gradient path of units whose state is on NVMe: the D2H copies land in registered windows (a pageable one
    raises, ``test_state_nvme_windows_are_pinned``), the accumulated gradient is read and the window written back on
    the host worker (``test_state_nvme_accumulated_gradient_is_read_off_the_training_thread``), so a step's threads
    never wait per unit for a gradient: the only host syncs of a step (before its gradients are read) are fetches
    waiting for their NVMe read, which the run with the state in RAM does not have, and the gradients are equal."""
    monkeypatch.setenv("LAZYTRAIN_SIMULATE_ASYNC_STALL_SHARE", "0")  # no worker lags a whole forward behind
    seen_ram: dict = {}
    seen: dict = {}
    ram = _grads(tmp_path / "ram", [], ga, seen=seen_ram)
    disk = _grads(tmp_path, [0, 1, 2, 3], ga, seen=seen)
    assert seen_ram["sync_reasons"] == {}, seen_ram
    assert set(seen["sync_reasons"]) <= {"a fetch waits for its read from NVMe"}, seen
    for n in ram:
        assert torch.equal(ram[n], disk[n]), n


def test_pinned_memory_is_allocated_through_lazytrain_pinned():
    """Every page-locked allocation of the package goes through `lazytrain_hf.pinned` (exact-size registered blocks,
    or the caching host allocator accounted at its power of two), where the simulation sees it: no tensor factory
    elsewhere is given ``pin_memory=`` (which would take an unaccounted power-of-two block that is never returned)."""
    import pathlib
    import re

    import lazytrain_hf

    root = pathlib.Path(lazytrain_hf.__file__).parent
    factory = re.compile(r"torch\.\w+\((?:[^()]|\([^()]*\))*\bpin_memory\s*=", re.S)
    found = [
        f"{path.relative_to(root)}: {m.group(0)[:80]!r}"
        for path in sorted(root.rglob("*.py"))
        if path.name != "pinned.py"
        for m in factory.finditer(path.read_text())
    ]
    assert found == [], found
