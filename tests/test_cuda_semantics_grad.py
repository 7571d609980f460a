"""CUDA semantics the simulated asynchronous CPU engine models, and the executor defects they exposed (gradients,
handles, background threads).

Each simulation addition is checked against the mechanism it imitates (the test fails when the imitation is
removed), and each defect has a regression test that failed before its fix.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import tiny_model
from test_streaming import assert_grads_equal, padded_batch, plain_grads

from lazytrain_hf import models, pinned
from lazytrain_hf.planner.plan import Plan
from lazytrain_hf.streaming import attach, chunked_causal_lm_loss
from lazytrain_hf.streams import set_param_data

CHUNK = 7


def _accumulators(p: torch.Tensor, uses: int, rebind) -> set[int]:
    """Ids of the AccumulateGrad nodes of ``p`` in a graph that uses it ``uses`` times, ``rebind`` in between."""
    nodes = []
    out = []
    for k in range(uses):
        if k:
            rebind()
        y = p * 2.0
        nodes.append(y.grad_fn.next_functions[0][0])
        out.append(y)
    return {id(n) for n in nodes}


def test_simulated_bind_drops_the_grad_accumulator():
    """Note: [Moving a parameter's data drops its gradient accumulator]: under the simulation a release and a rebind
    give the parameter a second AccumulateGrad node (as CUDA's set_data does on a device change); without it one."""
    p = torch.nn.Parameter(torch.ones(4))
    host, dev = torch.ones(4), torch.ones(4)

    def move(sim: bool):
        def rebind() -> None:
            set_param_data(p, host, sim)  # release
            set_param_data(p, dev, sim)  # bind again

        return rebind

    assert len(_accumulators(p, 2, move(sim=False))) == 1
    assert len(_accumulators(p, 2, move(sim=True))) == 2
    # the data really is the target (no copy, same storage)
    set_param_data(p, dev, True)
    assert p.data.data_ptr() == dev.data_ptr() and p.dtype == dev.dtype


def _streamed_plan(model) -> Plan:
    kinds = models.layer_kinds(model)
    return Plan.default(len(kinds), kinds=kinds, stream_embeddings=True, loss_chunk_tokens=CHUNK)


@pytest.mark.parametrize("path", ["chunked", "plain"])
def test_tied_stream_embeddings_grads_sum_both_uses(async_engine, path):
    """Defect: with tied embeddings and ``stream_embeddings`` the embedding is released after the lookup and bound
    again for the lm_head; on CUDA (and under the simulation) the tied weight then has two AccumulateGrad nodes and
    the unit completed on the head's part alone, leaving the lookup's part as a stray ``.grad``. Two micro-batches
    of gradient accumulation against the unstreamed model."""
    batches = [padded_batch(seed=1), padded_batch(seed=2)]
    ref = tiny_model("qwen3", tie_word_embeddings=True)
    model = tiny_model("qwen3", tie_word_embeddings=True)
    handle = attach(model, plan=_streamed_plan(model), device="cpu")
    for b in batches:
        if path == "chunked":
            h = ref.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
            want = chunked_causal_lm_loss(h, ref.lm_head.weight, b["labels"], chunk_tokens=CHUNK)
            got = handle.causal_lm_loss(model, b)
        else:
            want, got = ref(**b).loss, model(**b).loss
        (want / 2).backward()
        (got / 2).backward()
        assert torch.equal(got, want)
        # nothing stays behind on the parameter for the next micro-batch
        stray = model.model.embed_tokens.weight.grad
        assert stray is None, f"a stray .grad (norm {stray.norm():.4f}) is left on the tied weight"
    ref_g = plain_grads(ref)
    got_g = handle.grads()
    name = "model.embed_tokens.weight"
    assert torch.allclose(got_g[name], ref_g[name], rtol=0, atol=1e-6), (
        f"tied embedding gradient norm {got_g[name].norm():.4f}, unstreamed {ref_g[name].norm():.4f}"
    )
    assert_grads_equal(ref_g, got_g)
    handle.remove()


class _Owner:
    """Stands for the trainer: holds the handle and gives it guards that are its own bound methods."""

    def __init__(self, handle):
        self.handle = handle
        handle.fetch_guard = self.guard
        handle.resident_guard = self.resident
        handle.fetch_ready = self.ready
        handle.last_micro_batch = self.last

    def guard(self, i: int) -> None:
        pass

    def resident(self) -> None:
        pass

    def ready(self, i: int) -> bool:
        return True

    def last(self) -> bool:
        return True


@pytest.mark.parametrize("owner", [False, True], ids=["handle", "trainer-guards"])
def test_remove_leaves_no_reference_cycle(owner):
    """Defect: `remove()` left a handle <-> activation-engine cycle (and trainer guards pointing back at their
    owner), so the handle and every LayerStore (page-locked memory on CUDA) survived ``remove()`` + ``del`` until a
    full garbage collection. With the collector disabled they must be freed by reference counting alone."""
    import gc
    import weakref

    model = tiny_model("qwen3")
    kinds = models.layer_kinds(model)
    handle = attach(model, plan=Plan.default(len(kinds), kinds=kinds, stream_embeddings=True), device="cpu")
    holder = _Owner(handle) if owner else None
    model(**padded_batch()).loss.backward()
    handle.zero_grad()
    refs = [weakref.ref(handle)] + [weakref.ref(ls) for ls in handle.store.layers.values()]
    gc.collect()
    gc.disable()
    try:
        handle.remove()
        del handle
        if holder is not None:
            holder.handle = None
        alive = [r() for r in refs if r() is not None]
        assert not alive, f"{len(alive)} of {len(refs)} objects survive remove() + del: {type(alive[0]).__name__}"
    finally:
        gc.enable()
    # the model trains plainly afterwards
    model(**padded_batch()).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def _every_job_stalls(monkeypatch, workers: str) -> None:
    """Note: [Every background worker stalls for longer than a forward]: every job of ``workers`` stalls."""
    monkeypatch.setenv("LAZYTRAIN_SIMULATE_ASYNC", "1")
    monkeypatch.setenv("LAZYTRAIN_SIMULATE_ASYNC_STALL_SHARE", "1")
    monkeypatch.setenv("LAZYTRAIN_SIMULATE_ASYNC_STALL_WORKERS", workers)


def _track_delays(monkeypatch) -> list:
    """Every `SimDelay` created from now on (to read how many long stalls each worker took)."""
    from lazytrain_hf import streams

    made = []
    init = streams.SimDelay.__init__

    def track(self, name):
        init(self, name)
        made.append(self)

    monkeypatch.setattr(streams.SimDelay, "__init__", track)
    return made


def _long_stalls(delays: list, prefix: str) -> int:
    return sum(d.long_stalls for d in delays if d.name.startswith(prefix))


def test_stall_share_is_checked(monkeypatch):
    monkeypatch.setenv("LAZYTRAIN_SIMULATE_ASYNC_STALL_SHARE", "2")
    from lazytrain_hf.streams import SimDelay

    with pytest.raises(ValueError, match="LAZYTRAIN_SIMULATE_ASYNC_STALL_SHARE='2' must be a share of jobs in"):
        SimDelay("x")


def test_gradient_worker_stalls_are_waited_for(monkeypatch):
    """The gradient worker (host additions after each D2H copy) stalls for longer than a forward on every job; the
    accumulated gradients of two micro-batches must still be exact (`grads()` drains the worker first)."""
    _every_job_stalls(monkeypatch, "grad-worker")
    delays = _track_delays(monkeypatch)
    batches = [padded_batch(seed=1), padded_batch(seed=2)]
    ref = tiny_model("qwen3")
    model = tiny_model("qwen3")
    handle = attach(model, device="cpu")
    for b in batches:
        (ref(**b).loss / 2).backward()
        (model(**b).loss / 2).backward()
    assert_grads_equal(plain_grads(ref), handle.grads())
    assert _long_stalls(delays, "grad-worker") > 0 and _long_stalls(delays, "transfer") == 0
    handle.remove()


def test_optimizer_thread_stalls_are_waited_for(monkeypatch):
    """The overlapped optimizer thread stalls for longer than a forward on every layer's update: the next forward
    must still wait for each layer's update (Note: [Update before fetch]) and the run stay bit-exact."""
    from test_plan_space import assert_bit_exact, keep_all_plan, reference, train_plan

    from lazytrain_hf import streams

    kinds = models.layer_kinds(tiny_model("qwen3").config)
    ref = reference("qwen3", False, 1024, 1, torch.float32)
    _every_job_stalls(monkeypatch, "optimizer")
    plan = keep_all_plan(kinds, False, 1024)
    plan.optimizer_overlap = True
    delays = _track_delays(monkeypatch)
    got = train_plan("qwen3", plan, 1, torch.float32, simulate=True)
    assert _long_stalls(delays, "optimizer") > 0 and streams.long_stall_s() >= 0.05
    assert_bit_exact(got, ref, "optimizer overlap, every update stalled")


def test_nvme_writer_stalls_are_waited_for(monkeypatch, tmp_path):
    """The activation spill writer stalls for longer than a forward on every write: a reload must still read the
    bytes the write put there (it waits for the write), and the gradients stay bit-exact over two steps."""
    _every_job_stalls(monkeypatch, "nvme-write")
    delays = _track_delays(monkeypatch)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    b = {"input_ids": ids, "labels": ids}
    ref = tiny_model("qwen3")
    ref(**b).loss.backward()
    model = tiny_model("qwen3")
    plan = Plan.default(4, models.layer_kinds(model.config))
    plan.layers[1].policy = "offload_nvme"  # one layer: each of its saved tensors is a stalled write
    handle = attach(model, plan.validate(), "cpu", nvme_dir=str(tmp_path))
    for _ in range(2):
        model(**b).loss.backward()
    grads = handle.grads()
    bad = [n for n, p in ref.named_parameters() if not torch.equal(2 * p.grad, grads[n])]
    assert not bad, f"{len(bad)} gradients differ, first {bad[:3]}"
    assert _long_stalls(delays, "nvme-write") > 0 and _long_stalls(delays, "nvme-read") == 0
    handle.remove()


def _backward_syncs(monkeypatch, tmp_path, autograd_thread: bool) -> tuple[dict[str, int], set[str]]:
    """One step with an on-demand NVMe reload whose read stalls: the unpack in backward blocks the host."""
    monkeypatch.setenv("LAZYTRAIN_SIMULATE_AUTOGRAD_THREAD", "1" if autograd_thread else "0")
    _every_job_stalls(monkeypatch, "nvme-read")
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    model = tiny_model("qwen3")
    plan = Plan.default(4, models.layer_kinds(model.config))
    plan.layers[1].policy = "offload_nvme"
    plan.layers[1].reload_ahead = 0  # read when unpacked: the backward waits for it
    nvme = tmp_path / str(autograd_thread)
    nvme.mkdir()
    handle = attach(model, plan.validate(), "cpu", nvme_dir=str(nvme))
    threads: set[str] = set()
    p = model.model.layers[0].mlp.down_proj.weight
    hook = p.register_post_accumulate_grad_hook(lambda _: threads.add(threading.current_thread().name))
    model(input_ids=ids, labels=ids).loss.backward()
    reasons = dict(handle.trace.current["sync_reasons"])
    hook.remove()
    handle.remove()
    return reasons, threads


def test_backward_on_the_autograd_thread_counts_its_host_syncs(monkeypatch, tmp_path):
    """Note: [Backward runs on another thread]: under the profile, backward hooks run on the simulated autograd
    thread, and a host wait there (an NVMe read the backward needs) is counted as the step's host sync just as on the
    training thread. (Counting only the main thread's syncs missed every wait in a CUDA backward.)"""
    base, base_threads = _backward_syncs(monkeypatch, tmp_path, autograd_thread=False)
    got, got_threads = _backward_syncs(monkeypatch, tmp_path, autograd_thread=True)
    assert base_threads == {threading.main_thread().name}
    assert got_threads == {"lazytrain-sim-autograd"}
    assert base.get("activations: unpack waits for an NVMe read", 0) > 0, base
    assert got == base
    assert torch.autograd.backward.__module__ == "torch.autograd"  # the profile is undone by remove()


def test_optimizer_thread_orders_uploads_after_the_training_threads_compute(monkeypatch):
    """Resident parameters' uploads are issued on the optimizer thread, whose current CUDA stream is not the training
    thread's: they must be ordered after an event the training thread recorded, never `after_compute` (which the
    simulation refuses off the training and autograd threads)."""
    from test_plan_space import assert_bit_exact, reference, resident_plan, train_plan

    from lazytrain_hf.streams import Lanes

    kinds = models.layer_kinds(tiny_model("qwen3").config)
    # bf16: the resident parameters (embedding, norm, lm_head) are not their own fp32 masters, so they are uploaded
    ref = reference("qwen3", False, 1024, 1, torch.bfloat16)
    got = train_plan("qwen3", resident_plan(kinds, overlap=True), 1, torch.bfloat16, simulate=True)
    assert_bit_exact(got, ref, "resident layers, optimizer overlap, bf16")
    # the check itself: a compute-stream call from a thread of its own is refused
    lanes = Lanes(torch.device("cpu"), ("h2d",), "test")
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            lanes.compute_event()
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    lanes.close()
    assert errors and "whose current CUDA stream is the default stream" in str(errors[0])


# ------------------------------------------------------------------------------------------ smaller CUDA semantics
def test_numba_kernels_release_the_gil():
    """The optimizer thread's numba kernels run while the training thread drives the next forward: they must not
    hold the GIL (``nogil=True``), or every hook and kernel launch of that forward waits for the whole update."""
    from lazytrain_hf.optim import kernels

    if not kernels.NUMBA_AVAILABLE:
        pytest.skip("numba is not installed")
    from lazytrain_hf.optim import numba_kernels

    for fn in (numba_kernels.update_blocks, numba_kernels.adamw8bit_parallel):
        assert fn.targetoptions.get("nogil") is True, fn


def test_host_waits_use_blocking_events(monkeypatch):
    """Events the host may wait on are created with ``blocking=True`` (a default CUDA event's synchronize spins a
    core). Checked on the CUDA lane code with the torch.cuda entry points it calls replaced by recorders."""
    import contextlib

    from lazytrain_hf.streams import CudaLane, Lanes

    made = []

    class Event:
        def __init__(self, **kw):
            made.append(kw)

        def record(self, stream=None):
            pass

    class Stream:
        def __init__(self, *a, **k):
            pass

        def wait_event(self, ev):
            pass

        def wait_stream(self, s):
            pass

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    dev = torch.device("cuda", 0)
    dst, src = torch.zeros(4), torch.ones(4)
    CudaLane(dev).copy_all([(dst, src)], after_compute=True)
    lanes = Lanes(dev, ("h2d",), "test")
    lanes.compute_event()
    assert torch.equal(dst, src)
    assert made == [{"blocking": True}, {"blocking": True}], made


def test_stream_embeddings_moves_every_model_input_to_the_device():
    """With ``stream_embeddings`` ``model.device`` reads as the host (the embedding's host copy), so generate() builds
    every input there: the handle moves each tensor argument of the model's forward (attention mask, position ids,
    cache positions), not only the input ids. The root's pre-hook is called with the handle's device pointed at
    ``meta`` (the only other device a CPU build has), the inputs on the CPU."""
    model = tiny_model("qwen3", tie_word_embeddings=True)
    before = set(model._forward_pre_hooks)
    handle = attach(model, plan=_streamed_plan(model), device="cpu")
    added = [h for k, h in model._forward_pre_hooks.items() if k not in before]
    assert len(added) == 1, "no pre-hook on the model's forward"
    ids, mask = torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long)
    kwargs = {"attention_mask": mask, "position_ids": [ids], "cache": {"pos": ids}, "use_cache": False}
    handle.device = torch.device("meta")
    try:
        args, out = added[0](model, (ids,), kwargs)
    finally:
        handle.device = torch.device("cpu")
    assert args[0].device.type == "meta"
    assert out["attention_mask"].device.type == out["position_ids"][0].device.type == "meta"
    assert out["cache"]["pos"].device.type == "meta" and out["use_cache"] is False
    from lazytrain_hf.streaming.units import inputs_to_device

    # already there: the same tensor, no copy
    same = inputs_to_device((ids,), {}, torch.device("cpu"))[0][0]
    assert same is ids
    with torch.no_grad():
        assert model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0).shape == (1, 5)
    handle.remove()


def test_zero_grad_while_the_optimizer_thread_uploads(async_engine):
    """`TransferEngine.synchronize` (zero_grad, grads) filters the fetch events while the optimizer thread may insert
    one (an upload of a resident layer). An event whose ``query`` lets another thread upload meanwhile stands for
    that interleaving: the filtering must not see the dict change under it."""
    from lazytrain_hf.streaming.engine import TransferEngine
    from lazytrain_hf.streams import SimEvent

    engine = TransferEngine(torch.device("cpu"))
    engine.add_pool("layer", 256, 1)
    slot = engine.acquire("layer", urgent=False)
    block = pinned.PinnedBlock(64, True, "test upload source")  # lane copies need pinned host memory
    src = block.tensor
    inserted = threading.Event()

    class RacingEvent(SimEvent):
        def query(self) -> bool:
            def upload() -> None:
                engine.upload(slot, src, layer=7)
                inserted.set()

            threading.Thread(target=upload, daemon=True).start()
            inserted.wait(1.0)  # an unguarded dict is changed within this second; a locked one only after
            return True

    engine.copy_in(slot, src, layer=3)
    engine.mark_released(slot)
    engine._host_read[3] = RacingEvent(done=True)
    engine.synchronize()
    assert inserted.wait(10)
    engine.wait_host_reads(7)
    engine.close()
    block.release()


def test_first_fill_of_a_slot_waits_for_compute(async_engine):
    """A new slot's memory comes from the caching allocator on the compute stream, which may still have kernels
    queued on it: its first fill is ordered after a compute event like every refill, and the simulation refuses a
    copy into a slot that is not."""
    from lazytrain_hf.streaming.engine import TransferEngine

    engine = TransferEngine(torch.device("cpu"))
    engine.add_pool("layer", 256, 2)
    slots = [engine.acquire("layer", urgent=False) for _ in range(2)] + [engine.dedicated_slot("layer", 256)]
    assert all(s.released is not None for s in slots), [s.released for s in slots]
    slots[0].released = None
    with pytest.raises(RuntimeError, match="not ordered after the compute stream"):
        engine.copy_in(slots[0], torch.zeros(16, dtype=torch.uint8), layer=0)
    engine.close()
