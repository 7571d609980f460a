"""The plan knows its data-parallel world (Note: [The training state is partitioned by unit]): host footprint per
rank and per node, the ``net`` lane's ``reduce`` / ``gather`` bytes per rank, the world in the plan file, the
simulator's step and the MILP's optimizer times."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest

from lazytrain_hf.planner import hostmem, milp, schedule, stages
from lazytrain_hf.planner.costmodel import CostModel
from lazytrain_hf.planner.hardware import get_profile
from lazytrain_hf.planner.plan import Plan, PlanError
from lazytrain_hf.planner.schedule import StepBytes, UnitBytes
from lazytrain_hf.planner.simulate import simulate
from lazytrain_hf.planner.world import World, gather_receiver, unit_order
from lazytrain_hf.planner.worldcost import for_world
from lazytrain_hf.planner.zoo import get_config


# ---------------------------------------------------------------------------------------------- host footprint
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_node_footprint_is_one_shared_copy_plus_partitioned_state_plus_per_rank_terms(ranks):
    cm = CostModel.from_config(get_config("qwen2.5-7b"), "h800", 1024, 1)
    layers, emb, head = [lc.params for lc in cm.layers], cm.embed_params, cm.head_params
    one = hostmem.counts_footprint(layers, emb, head, cm.dtype_bytes)
    wf = hostmem.counts_world_footprint(layers, emb, head, cm.dtype_bytes, World(ranks, 1))
    assert len(wf.ranks) == ranks
    # the resident embedding and head, which every rank updates: fp32 master, gradient copy, 8-bit state
    res_master = res_grad = 4 * (emb + head)
    res_opt = hostmem.optimizer_state_bytes([emb, head])
    if ranks == 1:
        assert wf.ranks[0] == one and wf.shared == 0 and wf.node_total(0) == one.total
        return
    # ONE compute copy per node, in shared memory, not in any rank's total
    assert wf.shared == one.compute and all(fp.compute == 0 and fp.shared == one.compute for fp in wf.ranks)
    # masters, gradient accumulators and optimizer state of the streamed layers sum to one copy over the ranks
    assert sum(fp.grads for fp in wf.ranks) == one.grads
    assert sum(fp.masters for fp in wf.ranks) == one.masters + (ranks - 1) * res_master
    assert sum(fp.optimizer for fp in wf.ranks) == one.optimizer + (ranks - 1) * res_opt
    assert all(fp.resident == one.resident == res_grad for fp in wf.ranks)
    # every rank stages at most two units' fp32 gradients for the owners (equal layers: two layers)
    assert all(fp.reduce_staging == 2 * 4 * layers[0] for fp in wf.ranks)
    for fp in wf.ranks:
        assert (fp.staging, fp.activations, fp.checkpoint) == (one.staging, one.activations, one.checkpoint)
    # one rank's total, plus each further rank's replicated terms, plus every rank's reduce staging
    replicated = res_master + res_opt + res_grad + one.staging
    assert wf.node_total(0) == one.total + (ranks - 1) * replicated + ranks * 2 * 4 * layers[0]
    assert wf.node_total(0) == wf.shared + sum(fp.total for fp in wf.ranks)
    # each further rank adds a fifth of one rank's state (the resident embedding and head of Qwen2.5-7B, 1.1B
    # parameters, are most of it), not a copy of it
    assert wf.node_total(0) < one.total * (1 + 0.2 * (ranks - 1))


def test_two_nodes_each_hold_a_shared_copy_and_their_ranks_units():
    cm = CostModel.from_config(get_config("qwen2.5-7b"), "h800", 1024, 1)
    layers = [lc.params for lc in cm.layers]
    one = hostmem.counts_footprint(layers, cm.embed_params, cm.head_params, cm.dtype_bytes)
    wf = hostmem.counts_world_footprint(layers, cm.embed_params, cm.head_params, cm.dtype_bytes, World(4, 2))
    assert [len(wf.node_ranks(n)) for n in range(2)] == [2, 2]
    assert sum(fp.grads for fp in wf.ranks) == one.grads  # one copy of the state in the whole world
    for n in range(2):
        assert wf.node_total(n) == wf.shared + sum(fp.total for fp in wf.node_ranks(n))
    assert wf.total == max(wf.node_total(0), wf.node_total(1))


def test_units_of_a_model_and_state_files_are_the_owners():
    """A real model's units (`units_of_model`): each rank's state files hold its own units only, every streamed
    unit's gradient accumulator is on exactly one rank, and the per-rank budget leaves the node's state to it."""
    from conftest import tiny_model

    model = tiny_model("qwen3", num_hidden_layers=4)
    plan = Plan.default(4, stream_embeddings=True, state_nvme=[0, 1, 2, 3])
    units = hostmem.units_of_model(model, plan)
    kw = dict(state_nvme=frozenset(plan.state_nvme), gradient_accumulation_steps=2)
    one = hostmem.host_footprint(units, **kw)
    wf = hostmem.world_footprint(units, World(2, 1), **kw)
    assert sum(fp.nvme_state for fp in wf.ranks) == one.nvme_state > 0
    assert sum(fp.grads for fp in wf.ranks) == one.grads > 0  # the embedding and head units, in RAM
    owners = hostmem.unit_owner_map(units, World(2, 1))
    assert sorted(owners) == [-1, 0, 1, 2, 3, 4] and set(owners.values()) == {0, 1}
    # the schedule deals the same owners from its byte counts (trainable numels, not the padded accumulators)
    plan2 = dataclasses.replace(plan, world_size=2)
    assert schedule.unit_owners_of(plan2, schedule.sizes_from_model(model, plan2)) == owners
    # rank_activation_budget: what the node's shared copy and the ranks' other terms leave, split over its ranks
    budget = wf.node_peak(0) + 10_000
    assert hostmem.rank_activation_budget(budget, wf) == 5_000
    assert hostmem.rank_activation_budget(budget, one) == budget - max(one.total, one.save_peak)


# ---------------------------------------------------------------------------------------------- bytes per rank
def tiny_sizes(L: int = 4) -> StepBytes:
    return StepBytes(layers=[UnitBytes(weight=100, grad=50, train_elems=25, trainable=20) for _ in range(L)])


def test_bytes_per_rank_by_hand():
    """4 equal layers on 2 ranks on 2 nodes: owners [0, 1, 0, 1]. Rank 0 sends layers 1 and 3 (4 x 25 B each,
    every micro-batch) and receives their compute copies (100 B each, once per step) for its node."""
    plan = Plan.default(4, world_size=2, nodes=2)
    sizes = tiny_sizes()
    single = schedule.bytes_per_step(plan, sizes, 2, world=World(1, 1))
    assert "net" not in single
    for rank in (0, 1):
        got = schedule.bytes_per_step(plan, sizes, 2, rank=rank)
        assert got == {**single, "net": 2 * 2 * 4 * 25 + 2 * 100}, rank
    tr = [t for t in schedule.step_transfers(plan, sizes, 2, rank=0) if t.lane == "net"]
    assert [(t.what, t.layer, t.nbytes, t.stage, t.per_step, t.peer) for t in tr] == [
        ("reduce", 3, 100, 2 * 4 - 3, False, 1),
        ("reduce", 1, 100, 2 * 4 - 1, False, 1),
        ("gather", 1, 100, 2 * 4 + 1, True, 1),
        ("gather", 3, 100, 2 * 4 + 1, True, 1),
    ]


def test_gathers_go_to_the_rank_with_the_owners_local_rank():
    """4 ranks on 2 nodes, 4 layers: owners [0, 1, 2, 3]; rank 0 (node 0, local rank 0) receives the unit of rank 2
    (node 1, local rank 0), rank 1 that of rank 3; the ranks of one node send each other their gradients too."""
    world = World(4, 2)
    assert [gather_receiver(world, o, 0) for o in range(4)] == [-1, -1, 0, 1]
    assert [gather_receiver(world, o, 1) for o in range(4)] == [2, 3, -1, -1]
    plan = Plan.default(4, world_size=4, nodes=2)
    net = [t for t in schedule.step_transfers(plan, tiny_sizes(), rank=0) if t.lane == "net"]
    assert sorted((t.what, t.layer) for t in net) == [("gather", 2), ("reduce", 1), ("reduce", 2), ("reduce", 3)]
    # one node: no gathers, the shared copy is written by the owner
    plan1 = Plan.default(4, world_size=4, nodes=1)
    assert schedule.bytes_per_step(plan1, tiny_sizes(), rank=0)["net"] == 3 * 4 * 25


def test_state_on_nvme_is_read_and_written_by_its_owner_only():
    L = 2
    u = UnitBytes(weight=100, grad=50, train_elems=25, trainable=20, grad_file=100, state_read=300, state_write=200)
    sizes = StepBytes(layers=[u] * L)
    plan = Plan.default(L, state_nvme=[0, 1], world_size=2)
    one = schedule.bytes_per_step(plan, sizes, 2, world=World(1, 1))
    r0 = schedule.bytes_per_step(plan, sizes, 2, rank=0)  # owns layer 0
    # layer 1's state I/O (grad file written each micro-batch, read back once; state read / written) is rank 1's
    assert r0["nvme_write"] == one["nvme_write"] - (2 * 100 + 200)
    # reads: layer 1's forward fetches (each micro-batch) come from RAM (its owner's node copy), its gradient file and
    # state are rank 1's; rank 0 reads its own unit's new compute copy back into the node copy once per step
    # (Note [The state on NVMe works partitioned]; measured in tests/test_partitioned_state.py)
    assert r0["nvme_read"] == one["nvme_read"] - (2 * 100 + 100 + 300) + 100
    assert r0["net"] == 2 * 4 * 25
    with pytest.raises(ValueError, match="rank=2"):
        schedule.bytes_per_step(plan, sizes, rank=2)


def test_unit_order_is_the_embedding_layers_head():
    assert unit_order(3, True) == [-1, 0, 1, 2, 3]
    assert unit_order(3, False) == [0, 1, 2]


# ---------------------------------------------------------------------------------------------- plan file
def test_plan_json_round_trip_with_world_and_old_files_load(tmp_path):
    plan = Plan.default(3, world_size=8, nodes=2)
    back = Plan.from_json(plan.to_json())
    assert (back.world_size, back.nodes) == (8, 2) and back.world == World(8, 2)
    assert "world_size=8 nodes=2" in back.table()
    old = plan.to_dict()
    del old["world_size"], old["nodes"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = Plan.from_json(str(tmp_path / "old.json"))
    assert (loaded.world_size, loaded.nodes) == (1, 1) and "world_size" not in loaded.table()
    for bad in (dict(world_size=0), dict(nodes=0), dict(world_size=3, nodes=2), dict(world_size=2.0)):
        with pytest.raises(PlanError, match="world_size|nodes"):
            Plan.from_dict({**plan.to_dict(), **bad})


# ---------------------------------------------------------------------------------------------- simulator, MILP
def optimizer_bound_model() -> CostModel:
    hw = dataclasses.replace(get_profile("h800"), cpu_optimizer_params_per_s=2e8, net_gbps=400.0, shm_gbps=400.0)
    return CostModel.from_config(get_config("qwen2.5-1.5b"), hw, 1024, 4)


def test_simulated_step_shrinks_with_the_ranks_when_the_optimizer_dominates():
    """One rank per node: each updates 1/N of the layers at the node's whole optimizer rate. The stage model with
    the world's optimizer times (`for_world`, what the MILP plans with) agrees with the replay."""
    cm = optimizer_bound_model()
    steps = {}
    for n in (1, 2, 4):
        plan = Plan.default(cm.num_layers, world_size=n, nodes=n)
        sim = simulate(plan, cm)
        steps[n] = sim.step_time_s
        ev = stages.evaluate_plan(plan, for_world(cm, plan.world))
        assert abs(ev.step_time_s - sim.step_time_s) <= 0.05 * sim.step_time_s, (n, ev.step_time_s, sim.step_time_s)
        if n > 1:
            assert sim.lanes["net"], "the reduces and gathers are replayed on the net lane"
    assert steps[1] > steps[2] > steps[4] and steps[4] < 0.5 * steps[1], steps


def test_ranks_of_one_node_share_its_optimizer_rate():
    """Four ranks on one node each update a quarter of the layers at a quarter of the node's rate, and the
    resident embedding (every rank updates it) four times: the step is not shorter than one rank's."""
    cm = optimizer_bound_model()
    one = simulate(Plan.default(cm.num_layers), cm).step_time_s
    four = simulate(Plan.default(cm.num_layers, world_size=4, nodes=1), cm).step_time_s
    assert four >= one


def test_slow_network_makes_the_reduces_the_step():
    """The same world with the default 5 GB/s between nodes: the rank's net lane (fp32 reduces every micro-batch)
    lasts longer than the compute, and the simulated step says so."""
    cm = CostModel.from_config(get_config("qwen2.5-1.5b"), "h800", 1024, 4)
    plan = Plan.default(cm.num_layers, world_size=2, nodes=2)
    sim = simulate(plan, cm)
    net_s = sum(e - s for s, e, _ in sim.lanes["net"])
    compute_s = sum(e - s for s, e, _ in sim.lanes["compute"])
    assert net_s > compute_s and sim.step_time_s >= net_s * 0.99


def test_plan_for_model_records_the_world():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = milp.plan_for_model(
            "qwen2.5-1.5b", "h800", 1024, micro_batch_size=2, solver="cbc", time_limit=20, world=World(4, 2)
        )
    assert (plan.world_size, plan.nodes) == (4, 2)
    assert plan.predicted["bytes_per_step"]["net"] > 0
    assert Plan.from_json(plan.to_json()).world == World(4, 2)


def test_world_cost_model_keeps_its_world_across_batches():
    cm = optimizer_bound_model()
    assert for_world(cm, World(1, 1)) is cm and for_world(cm, None) is cm
    wcm = for_world(cm, World(4, 4))
    assert wcm.with_batch(4).world == World(4, 4) and wcm.with_state_nvme([0]).world == World(4, 4)
    # four ranks on four nodes each update a quarter of the layers at a node's whole rate: the layers' updates
    # take a quarter of the time (the gathers on a fast network add little)
    (e1, c1, _), (e4, c4, _) = stages.optimizer_finish_times(cm), stages.optimizer_finish_times(wcm)
    assert c4[-1] - e4 < 0.3 * (c1[-1] - e1)


def test_profiles_without_network_figures_load_and_bad_ones_are_refused(tmp_path):
    from lazytrain_hf.planner.hardware import HardwareProfile

    d = get_profile("h800").to_dict()
    assert d["net_gbps"] == 5.0 and d["shm_gbps"] == 10.0 and get_profile("cpu").shm_gbps == 19.0
    old = {k: v for k, v in d.items() if k not in ("net_gbps", "shm_gbps")}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert HardwareProfile.from_json(str(tmp_path / "old.json")).net_gbps == 5.0
    with pytest.raises(ValueError, match="net_gbps=0"):
        HardwareProfile.from_dict({**d, "net_gbps": 0})


# ---------------------------------------------------------------------------------------------- dp_reduce
def test_device_reduce_bytes_per_rank_by_hand():
    """dp_reduce="device", 4 equal layers on 2 ranks of one node (owners [0, 1, 0, 1]), GA 2: rank 0 copies D2H the
    gradients of layers 0 and 2 only (50 B each, every micro-batch) and reduces those of layers 1 and 3 on the device
    (their 50 B, in their dtype, every micro-batch); one process's other lanes are unchanged."""
    plan = Plan.default(4, world_size=2, dp_reduce="device")
    sizes = tiny_sizes()
    single = schedule.bytes_per_step(plan, sizes, 2, world=World(1, 1))
    for rank in (0, 1):
        got = schedule.bytes_per_step(plan, sizes, 2, rank=rank)
        assert got == {**single, "d2h": single["d2h"] - 2 * 2 * 50, "net": 2 * 2 * 50}, rank
    tr = [t for t in schedule.step_transfers(plan, sizes, 2, rank=0) if t.what in ("grad", "reduce_device")]
    assert [(t.lane, t.what, t.layer, t.nbytes, t.stage, t.peer) for t in tr] == [
        ("net", "reduce_device", 3, 50, 2 * 4 - 3, 1),
        ("d2h", "grad", 2, 50, 2 * 4 - 2, None),
        ("net", "reduce_device", 1, 50, 2 * 4 - 1, 1),
        ("d2h", "grad", 0, 50, 2 * 4, None),
    ]


def test_plan_file_keeps_dp_reduce_and_old_files_reduce_on_the_host(tmp_path):
    plan = Plan.default(3, world_size=2, dp_reduce="device")
    back = Plan.from_json(plan.to_json())
    assert back.dp_reduce == "device" and "dp_reduce=device" in back.table()
    old = plan.to_dict()
    del old["dp_reduce"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Plan.from_json(str(tmp_path / "old.json")).dp_reduce == "host"
    with pytest.raises(PlanError, match="dp_reduce='nccl'.*'host'.*'device'"):
        Plan.from_dict({**plan.to_dict(), "dp_reduce": "nccl"})


def _decided(hw) -> Plan:
    from lazytrain_hf.planner import dpreduce

    cm = CostModel.from_config(get_config("qwen2.5-1.5b"), hw, 1024, 4)
    return dpreduce.decide(Plan.default(cm.num_layers), cm, World(2, 1))


def test_planner_reduces_on_the_device_when_pcie_binds_and_on_the_host_when_the_device_link_is_slow():
    """The decision (`dpreduce.decide`, the shorter simulated step of the slowest rank): on an H800 whose D2H is
    slow (PCIe-bound: every rank copying every unit's gradient is the bottleneck) the device path wins; with a slow
    device interconnect (the reduce, ordered on the compute stream, stalls the backward) the host path does. The
    bundled profiles: NVLink-class devices reduce on the device, PCIe-class GeForce cards on the host."""
    pcie = _decided(dataclasses.replace(get_profile("h800"), d2h_gbps=2.0))
    slow_link = _decided(dataclasses.replace(get_profile("h800"), device_net_gbps=0.5))
    print("PCIe-bound", pcie.predicted["dp_reduce_step_s"], "slow link", slow_link.predicted["dp_reduce_step_s"])
    assert pcie.dp_reduce == "device" and slow_link.dp_reduce == "host"
    for plan in (pcie, slow_link):
        steps = plan.predicted["dp_reduce_step_s"]
        assert steps[plan.dp_reduce] == min(steps.values()) and (plan.world_size, plan.nodes) == (2, 1)
    assert _decided("h200").dp_reduce == "device" and _decided("rtx4090").dp_reduce == "host"
    one = dataclasses.replace(Plan.default(2), dp_reduce="device")
    from lazytrain_hf.planner import dpreduce

    assert dpreduce.decide(one, optimizer_bound_model()).dp_reduce == "host"  # one rank: nothing to reduce


def test_device_net_figures_of_the_profiles():
    from lazytrain_hf.planner.hardware import HardwareProfile

    names = ("h800", "h100", "h200", "a100-80g", "rtx3090", "rtx4090")
    assert [get_profile(n).device_net_gbps for n in names] == [160.0, 360.0, 360.0, 240.0, 12.0, 12.0]
    d = get_profile("h200").to_dict()
    del d["device_net_gbps"]
    assert HardwareProfile.from_dict(d).device_net_gbps == 12.0  # a profile written before the field
    with pytest.raises(ValueError, match="device_net_gbps=-1"):
        HardwareProfile.from_dict({**d, "device_net_gbps": -1})


# ---------------------------------------------------------------------------------------------- dp_reduce_every
def test_step_reduce_bytes_per_rank_by_hand():
    """Note: [Gradients reduced once per step]: 4 equal layers on 2 ranks of one node (owners [0, 1, 0, 1]), GA 2:
    with ``dp_reduce_every="step"`` rank 0 sends layers 1 and 3 (4 x 25 B each) once per step, not every
    micro-batch: the ``net`` bytes are 1/2 of the per-micro-batch reduce's, every other lane unchanged; without
    gradient accumulation both are the same."""
    sizes = tiny_sizes()
    every = Plan.default(4, world_size=2)
    once = dataclasses.replace(every, dp_reduce_every="step")
    for rank in (0, 1):
        mb, step = (schedule.bytes_per_step(p, sizes, 2, rank=rank) for p in (every, once))
        assert mb["net"] == 2 * 2 * 4 * 25 and step == {**mb, "net": 2 * 4 * 25}, (rank, mb, step)
        assert schedule.bytes_per_step(every, sizes, 1, rank=rank) == schedule.bytes_per_step(once, sizes, 1, rank=rank)
    tr = [t for t in schedule.step_transfers(once, sizes, 2, rank=0) if t.lane == "net"]
    assert [(t.what, t.layer, t.nbytes, t.stage, t.per_step, t.peer) for t in tr] == [
        ("reduce", 3, 100, 2 * 4 - 3, True, 1),
        ("reduce", 1, 100, 2 * 4 - 1, True, 1),
    ]


def test_plan_file_keeps_dp_reduce_every_and_old_files_reduce_every_micro_batch(tmp_path):
    plan = Plan.default(3, world_size=2, dp_reduce_every="step")
    back = Plan.from_json(plan.to_json())
    assert back.dp_reduce_every == "step" and "dp_reduce=host/step" in back.table()
    old = plan.to_dict()
    del old["dp_reduce_every"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Plan.from_json(str(tmp_path / "old.json")).dp_reduce_every == "micro_batch"
    with pytest.raises(PlanError, match="dp_reduce_every='epoch'.*'micro_batch'.*'step'"):
        Plan.from_dict({**plan.to_dict(), "dp_reduce_every": "epoch"})
    with pytest.raises(PlanError, match="dp_reduce='device' with dp_reduce_every='step'.*dp_reduce='host'"):
        Plan.from_dict({**plan.to_dict(), "dp_reduce": "device"})


def test_node_footprint_holds_the_step_accumulators_of_the_units_a_rank_does_not_own():
    """``dp_reduce_every="step"``: each rank holds an fp32 accumulator of every decoder layer another rank owns
    (``step_grads``, 4 B per element) instead of the reduce staging of two of them."""
    cm = CostModel.from_config(get_config("qwen2.5-1.5b"), "rtx4090", 1024, 4)
    layers, emb, head = [lc.params for lc in cm.layers], cm.embed_params, cm.head_params
    world = World(2, 1)
    mb = hostmem.counts_world_footprint(layers, emb, head, cm.dtype_bytes, world)
    step = hostmem.counts_world_footprint(layers, emb, head, cm.dtype_bytes, world, "step")
    for r in range(2):
        others = sum(4 * n for i, n in enumerate(layers) if i % 2 != r)  # owners alternate: equal layers
        assert step.ranks[r].step_grads == others and step.ranks[r].reduce_staging == 0
        assert step.ranks[r].total == mb.ranks[r].total - mb.ranks[r].reduce_staging + others
    print(f"node host bytes: micro_batch {mb.node_peak(0) / 2**30:.2f} GiB, step {step.node_peak(0) / 2**30:.2f} GiB")


def _slow_links(g: int, **kw) -> Plan:
    from lazytrain_hf.planner import dpreduce

    hw = dataclasses.replace(get_profile("rtx4090"), shm_gbps=2.0, device_net_gbps=2.0)
    cm = CostModel.from_config(get_config("qwen2.5-1.5b"), hw, 1024, 4)
    return dpreduce.decide(Plan.default(cm.num_layers), cm, World(2, 1), g, **kw)


def test_planner_reduces_once_per_step_where_the_reduce_binds_and_the_accumulators_fit():
    """`dpreduce.decide` over {host, device} x {micro_batch, step} by the simulated optimizer step of g micro-batches:
    a world whose reduces bind (2 GB/s between the ranks, on the host and between the devices) reduces once per step
    with gradient accumulation 2 or 4, every micro-batch without it (the two are the same; "host/step" not even
    simulated) and when the node's host memory cannot hold the accumulators; a forced cadence is kept."""
    for g in (2, 4):
        plan = _slow_links(g)
        steps = plan.predicted["dp_reduce_step_s"]
        print(f"g={g}: {steps}")
        assert (plan.dp_reduce, plan.dp_reduce_every) == ("host", "step")
        assert steps["host/step"] < min(steps["host"], steps["device"])
    one = _slow_links(1)
    assert one.dp_reduce_every == "micro_batch" and "host/step" not in one.predicted["dp_reduce_step_s"]
    need = _slow_links(4).predicted["dp_reduce_step_host_bytes"]
    tight = _slow_links(4, host_memory_bytes=need - 1)
    assert tight.dp_reduce_every == "micro_batch" and "host/step" not in tight.predicted["dp_reduce_step_s"]
    assert _slow_links(4, host_memory_bytes=need).dp_reduce_every == "step"
    forced = _slow_links(4, every="micro_batch")
    assert forced.dp_reduce_every == "micro_batch" and set(forced.predicted["dp_reduce_step_s"]) == {"host", "device"}
    assert _slow_links(1, every="step").dp_reduce_every == "step"
    with pytest.raises(ValueError, match="dp_reduce='device' with dp_reduce_every='step'"):
        _slow_links(4, every="step", mode="device")


def test_simulated_step_of_several_micro_batches_sends_the_reduces_once_with_step():
    """``simulate(..., micro_batches=g)``: the period is an optimizer step of g micro-batches (its tokens g times
    one micro-batch's), and the ``net`` lane of a step-reduce plan is busy 1/g as long as the per-micro-batch one."""
    cm = CostModel.from_config(get_config("qwen2.5-1.5b"), "rtx4090", 1024, 4)
    plan = Plan.default(cm.num_layers, world_size=2)
    one = simulate(plan, cm, rank=0)
    mb = simulate(plan, cm, rank=0, micro_batches=4)
    step = simulate(dataclasses.replace(plan, dp_reduce_every="step"), cm, rank=0, micro_batches=4)
    assert mb.tokens_per_s * mb.step_time_s == pytest.approx(4 * one.tokens_per_s * one.step_time_s)
    busy = [r.busy_fraction("net") * r.step_time_s for r in (mb, step)]
    assert busy[1] == pytest.approx(busy[0] / 4, rel=1e-6), busy
    with pytest.raises(ValueError, match="micro_batches=0"):
        simulate(plan, cm, micro_batches=0)


def test_run_arguments_force_or_leave_the_reduce_cadence_to_the_plan(monkeypatch):
    """`training.planning.set_dp_reduce`: ``planner_dp_reduce_every="auto"`` with a cost model (rank 0 after its
    solve) is the planner's choice for the run's gradient accumulation; without one (a plan file, the plan rank 0
    broadcast) the plan's own, a forced value overriding it (forcing "device" on a "step" plan makes it reduce
    every micro-batch, forcing "step" on a "device" plan reduces on the host)."""
    from types import SimpleNamespace

    from lazytrain_hf.training.planning import set_dp_reduce

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    hw = dataclasses.replace(get_profile("rtx4090"), shm_gbps=2.0, device_net_gbps=2.0)
    cm = CostModel.from_config(get_config("qwen2.5-1.5b"), hw, 1024, 4)

    def args(mode="auto", every="auto", g=4):
        return SimpleNamespace(
            world_size=2, planner_dp_reduce=mode, planner_dp_reduce_every=every, gradient_accumulation_steps=g
        )

    plan = Plan.default(cm.num_layers)
    set_dp_reduce(plan, args(), cm)
    assert (plan.dp_reduce, plan.dp_reduce_every) == ("host", "step")
    set_dp_reduce(plan, args(g=1))  # no cost model: the plan's
    assert (plan.dp_reduce, plan.dp_reduce_every) == ("host", "step")
    set_dp_reduce(plan, args(mode="device"))
    assert (plan.dp_reduce, plan.dp_reduce_every) == ("device", "micro_batch")
    set_dp_reduce(plan, args(every="step"))
    assert (plan.dp_reduce, plan.dp_reduce_every) == ("host", "step")
    set_dp_reduce(plan, args(every="micro_batch"), cm)
    assert plan.dp_reduce_every == "micro_batch"
