"""The training state partitioned by unit across data-parallel ranks, in one process: what the host store holds for
units another rank owns, the gradients handed to the owner reduce (bit for bit the device gradients, alignment gaps
zeroed), the unit order of `unit_owners_of`, and the errors. The collectives themselves run in
tests/test_trainer_ddp.py (several processes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_model
from test_streaming import padded_batch

from lazytrain_hf import models
from lazytrain_hf.planner import hostmem
from lazytrain_hf.planner.plan import Plan
from lazytrain_hf.streaming import attach
from lazytrain_hf.training import dataparallel
from lazytrain_hf.training.updater import LayerwiseUpdater


def _plan(model, stream_embeddings: bool = False) -> Plan:
    kinds = models.layer_kinds(model.config)
    plan = Plan.default(len(kinds), kinds=kinds, prefetch_depth=1)
    plan.stream_embeddings = stream_embeddings
    return plan


def test_unit_owners_in_unit_order():
    """Units in unit order (embedding, layers 0..L-1, head), dealt largest first by trainable elements (planner/world.py)."""
    model = tiny_model("qwen3", seed=1)
    assert dataparallel.unit_owners_of(model, _plan(model), 2) == {0: 0, 1: 1, 2: 0, 3: 1}
    owners = dataparallel.unit_owners_of(model, _plan(model, stream_embeddings=True), 2)
    assert list(owners) == [-1, 0, 1, 2, 3, 4]
    # largest first: the head (lm_head and the final norm) to rank 0, the embedding to rank 1, then the layers
    assert owners == {-1: 1, 0: 0, 1: 1, 2: 0, 3: 1, 4: 0}
    assert dataparallel.unit_owners_of(model, _plan(model), 1) == {0: 0, 1: 0, 2: 0, 3: 0}


def test_remote_units_hold_a_compute_copy_only():
    model = tiny_model("qwen3", seed=1)
    full = attach(model, _plan(model))
    whole = full.store.host_bytes()
    full.remove()
    handle = attach(model, _plan(model), unit_owners={0: 0, 1: 1, 2: 0, 3: 1}, rank=0)
    try:
        for i, ls in handle.store.layers.items():
            assert ls.remote == (i in (1, 3))
            assert (ls.master is None and ls.grad is None) == ls.remote
            assert bool(ls.master_views) != ls.remote and bool(ls.grad_views) != ls.remote
        part = handle.store.host_bytes()
        print(f"host store bytes: every unit {whole}, rank 0 of 2 {part}")
        assert part["compute"] == whole["compute"]  # every rank computes every unit
        assert 2 * part["grad"] == whole["grad"] and 2 * part["master"] == whole["master"]
        with pytest.raises(ValueError, match="data_parallel"):
            LayerwiseUpdater(handle)
    finally:
        handle.remove()


def _unpartitioned_grads(batch, stream_embeddings: bool) -> dict[int, torch.Tensor]:
    """Each unit's fp32 accumulator after one backward of ``batch`` on one process (no partition)."""
    ref_model = tiny_model("qwen3", seed=1)
    ref = attach(ref_model, _plan(ref_model, stream_embeddings))
    ref_model(**batch).loss.backward()
    ref.synchronize()
    want = {i: ls.grad.clone() for i, ls in ref.store.layers.items()}
    ref.remove()
    return want


@pytest.mark.parametrize("stream_embeddings", [False, True])
def test_gradients_handed_to_the_owner_reduce_are_the_device_gradients(stream_embeddings):
    """Without collectives: the reducer sees, for every unit and on every micro-batch, a flat fp32 buffer holding the
    unit's gradient in the accumulator layout (the owner's accumulator or, for units another rank owns, the reused
    staging), bit for bit the unpartitioned accumulator, alignment gaps zero. With the embedding and head streamed
    the staging is reused across units of different layouts (the gaps held another unit's gradient)."""
    batch = padded_batch()
    want = _unpartitioned_grads(batch, stream_embeddings)

    model = tiny_model("qwen3", seed=1)
    owners = dataparallel.unit_owners_of(model, _plan(model, stream_embeddings), 2)
    handle = attach(model, _plan(model, stream_embeddings), unit_owners=owners, rank=0)
    seen: dict[int, tuple[torch.Tensor, int, bool]] = {}
    try:
        with pytest.raises(RuntimeError, match="owner_grad_reducer"):
            model(**batch).loss.backward()
        handle.remove()
        model = tiny_model("qwen3", seed=1)
        handle = attach(model, _plan(model, stream_embeddings), unit_owners=owners, rank=0)
        handle.owner_grad_reducer = lambda unit, flat, owner, last: seen.__setitem__(unit, (flat.clone(), owner, last))
        model(**batch).loss.backward()
        handle.synchronize()
        assert sorted(seen) == sorted(want)
        for i, (flat, owner, last) in seen.items():
            assert owner == owners[i] and last
            assert torch.equal(flat, want[i]), f"unit {i}: {(flat - want[i]).abs().max()}"
        remote = [i for i, ls in handle.store.layers.items() if ls.remote]
        assert remote and all(i not in handle.sq_norms for i in remote)  # a non-owner takes no norm
        assert handle.trace.current["bytes"]["net"] == sum(4 * want[i].numel() for i in remote)
    finally:
        handle.remove()


@pytest.mark.parametrize("stream_embeddings", [False, True])
def test_device_reduce_hands_the_device_gradients_and_skips_the_d2h_of_other_ranks_units(stream_embeddings):
    """Note: [Gradients reduced on the device skip the other ranks' D2H], without collectives: the device reducer
    gets every unit's device gradients (bit for bit one process's, here left as they are: the mean of two equal
    ranks), the owner's accumulators then equal one process's, the units another rank owns cross nothing D2H and are
    recorded on ``net`` as ``reduce_device`` with their gradient bytes, and the trace equals the plan's prediction
    for rank 0 of 2 (planner/schedule.py)."""
    from lazytrain_hf.planner import schedule
    from lazytrain_hf.planner.world import World

    batch = padded_batch()
    want = _unpartitioned_grads(batch, stream_embeddings)

    model = tiny_model("qwen3", seed=1)
    plan = _plan(model, stream_embeddings)
    plan.world_size, plan.dp_reduce = 2, "device"
    owners = dataparallel.unit_owners_of(model, plan, 2)
    handle = attach(model, plan, unit_owners=owners, rank=0)
    seen: dict[int, tuple[list[torch.Tensor], int]] = {}
    try:
        handle.owner_grad_reducer = lambda *a: pytest.fail(f"host reduce {a[0]} with dp_reduce='device'")
        handle.owner_device_reducer = lambda unit, grads, owner: seen.__setitem__(
            unit, ([g.clone() for g in grads], owner)
        )
        model(**batch).loss.backward()
        handle.synchronize()
        assert sorted(seen) == sorted(want) and all(owner == owners[i] for i, (_, owner) in seen.items())
        remote = sorted(i for i, ls in handle.store.layers.items() if ls.remote)
        own = sorted(i for i in want if i not in remote)
        assert remote and own
        for i in own:
            assert torch.equal(handle.store.layers[i].grad, want[i]), f"unit {i}"
            assert i in handle.sq_norms  # the owner's norm, taken of the reduced gradient
        transfers = handle.trace.current["transfers"]
        d2h = {t["layer"] for t in transfers if t["lane"] == "d2h" and t["what"] == "grad" and t["layer"] is not None}
        assert d2h == set(own), d2h  # no D2H of the units rank 1 owns
        net = {t["layer"]: t["bytes"] for t in transfers if t["lane"] == "net"}
        assert {t["what"] for t in transfers if t["lane"] == "net"} == {"reduce_device"}
        assert net == {i: sum(g.numel() * g.element_size() for g in seen[i][0]) for i in remote}
        sizes = schedule.sizes_from_model(model, plan)
        predicted = schedule.bytes_per_step(plan, sizes, 1, World(2, 1), rank=0)
        got = {lane: handle.trace.current["bytes"][lane] for lane in predicted}
        assert got == predicted, (got, predicted)
    finally:
        handle.remove()


def _step_grads(handle, model, batches: list) -> None:
    """``batches`` as the micro-batches of one optimizer step on ``handle`` (the last one ends the step)."""
    for k, b in enumerate(batches):
        handle.last_micro_batch = k == len(batches) - 1
        model(**b).loss.backward()
    handle.synchronize()


def test_step_reduce_accumulates_on_every_rank_and_reduces_once():
    """Note: [Gradients reduced once per step], without collectives: two ranks, gradient accumulation 2, the plan's
    ``dp_reduce_every == "step"``. Each rank adds its micro-batches' gradients of a unit it does not own into its
    own fp32 accumulator and hands it to the owner reduce once, after the last micro-batch; the reduce emulated here
    (the other rank's buffer added, divided by 2) gives the owner's accumulator the one-process accumulator of all
    four micro-batches, halved, within fp32 rounding (the order of the sums differs: each rank sums its micro-batches
    first). ``net`` carries each unit another rank owns once per step: 1/2 of the per-micro-batch mode, and the
    trace equals the plan's prediction of a step of 2 micro-batches for each rank."""
    from lazytrain_hf.planner import schedule
    from lazytrain_hf.planner.world import World

    a1, a2 = padded_batch(seed=11), padded_batch(seed=12)
    b1, b2 = padded_batch(seed=21), padded_batch(seed=22)
    ref_model = tiny_model("qwen3", seed=1)
    ref = attach(ref_model, _plan(ref_model))
    _step_grads(ref, ref_model, [a1, b1, a2, b2])  # one process, the same global batch
    want = {i: ls.grad.clone() / 2 for i, ls in ref.store.layers.items()}
    ref.remove()

    def run(rank: int, batches: list, reducer) -> tuple[dict[int, torch.Tensor], dict[str, int], dict[int, int]]:
        model = tiny_model("qwen3", seed=1)
        plan = _plan(model)
        plan.world_size, plan.dp_reduce_every = 2, "step"
        owners = dataparallel.unit_owners_of(model, plan, 2)
        handle = attach(model, plan, unit_owners=owners, rank=rank)
        handle.dp_reduce_every = "step"
        calls: dict[int, int] = {}

        def count(unit, flat, owner, last):
            calls[unit] = calls.get(unit, 0) + 1
            reducer(unit, flat, owner, last)

        handle.owner_grad_reducer = count
        try:
            _step_grads(handle, model, batches)
            own = {i: ls.grad.clone() for i, ls in handle.store.layers.items() if not ls.remote}
            # the accumulators of the units another rank owns: what the planner counts (planner/hostmem.py)
            planned = hostmem.run_footprint(model, plan, device="cpu", gradient_accumulation_steps=2, rank=rank)
            assert handle.step_accumulator_bytes == planned.step_grads > 0 and planned.reduce_staging == 0
            got = dict(handle.trace.current["bytes"])
            predicted = schedule.bytes_per_step(plan, schedule.sizes_from_model(model, plan), 2, World(2, 1), rank)
            assert {lane: got[lane] for lane in predicted} == predicted, (got, predicted)
            mb = dataclasses.replace(plan, dp_reduce_every="micro_batch")
            per_mb = schedule.bytes_per_step(mb, schedule.sizes_from_model(model, mb), 2, World(2, 1), rank)["net"]
            assert got["net"] > 0 and 2 * got["net"] == per_mb, (got["net"], per_mb)
            print(f"rank {rank}: net bytes per step {got['net']} (every micro-batch: {per_mb})")
            return own, got, calls
        finally:
            handle.remove()

    sent: dict[int, torch.Tensor] = {}

    def send(unit, flat, owner, last):  # rank 1: what it hands the reduce of the units rank 0 owns
        assert last
        if owner == 0:
            sent[unit] = flat.clone()

    _, _, calls1 = run(1, [b1, b2], send)

    def receive(unit, flat, owner, last):  # rank 0: the reduce's result in the owner's accumulator
        assert last
        if owner == 0:
            flat.add_(sent[unit]).div_(2)

    own, _, calls0 = run(0, [a1, a2], receive)
    assert calls0 == calls1 == {i: 1 for i in want}  # every unit reduced once per step, on both ranks
    assert own and set(own) == set(sent)
    worst = 0.0
    for i, g in own.items():
        assert torch.allclose(g, want[i], rtol=1e-5, atol=1e-7), f"unit {i}: {(g - want[i]).abs().max()}"
        worst = max(worst, float((g - want[i]).abs().max()))
    print(f"owner's accumulators vs one process: max abs diff {worst:.3g}")


def test_state_on_nvme_is_read_by_its_owner_only(tmp_path):
    """Note: [The state on NVMe works partitioned]: every unit's state on NVMe, two ranks, gradient accumulation 2,
    reduced once per step, without collectives. A rank's state files hold its own units only, so it reads from NVMe
    the compute copies of its own units at their fetches and their accumulated gradients before the second
    micro-batch adds into them; the compute copies of the units another rank owns come from RAM (the node copy). The
    trace's ``nvme_read`` of the micro-batches (the optimizer step's state reads are the slow launch's:
    tests/test_trainer_ddp.py) equals the plan's prediction for each rank, by unit, and the two ranks read less
    than one process."""
    from lazytrain_hf.planner import schedule
    from lazytrain_hf.planner.world import World

    batches = [padded_batch(seed=11), padded_batch(seed=12)]
    read: dict[int, dict] = {}
    for rank in (0, 1):
        model = tiny_model("qwen3", seed=1)
        plan = _plan(model, stream_embeddings=True)
        plan.state_nvme = [-1, *range(plan.num_layers), plan.num_layers]
        plan.world_size, plan.dp_reduce_every = 2, "step"
        owners = dataparallel.unit_owners_of(model, plan, 2)
        (tmp_path / str(rank)).mkdir()
        handle = attach(model, plan, unit_owners=owners, rank=rank, state_nvme_dir=str(tmp_path / str(rank)))
        handle.dp_reduce_every = "step"
        handle.owner_grad_reducer = lambda unit, flat, owner, last: None
        try:
            assert sorted(handle.nvme_state.units) == sorted(k for k, r in owners.items() if r == rank)
            _step_grads(handle, model, batches)
            got: dict[tuple, int] = {}
            for t in handle.trace.current["transfers"]:
                if t["lane"] == "nvme_read":
                    got[(t["what"], t["layer"])] = got.get((t["what"], t["layer"]), 0) + t["bytes"]
            sizes = schedule.sizes_from_model(model, plan)
            want: dict[tuple, int] = {}
            for t in schedule.step_transfers(plan, sizes, 2, World(2, 1), rank):
                if t.lane == "nvme_read" and t.stage <= 2 * plan.num_layers:  # the micro-batches, not the update
                    key = ("fetch" if t.what.startswith("fetch") else t.what, t.layer)
                    want[key] = want.get(key, 0) + t.nbytes * (1 if t.per_step else 2)
            assert got == want, (rank, got, want)
            assert {k for _, k in got} == set(handle.nvme_state.units)  # its own units only
            read[rank] = got
        finally:
            handle.remove()
    one = schedule.bytes_per_step(plan, sizes, 2, World(1, 1))["nvme_read"]
    print(f"micro-batch NVMe reads per step: rank 0 {sum(read[0].values())}, rank 1 {sum(read[1].values())}")
    assert 0 < sum(read[0].values()) + sum(read[1].values()) < one
