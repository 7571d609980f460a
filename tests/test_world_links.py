"""Note: [The world's links are measured] (lazytrain_hf/training/world_links.py): the link bandwidths of a
data-parallel world, timed by its ranks (gloo on CPU), agreed on every rank, and the figures rank 0 plans with."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from lazytrain_hf.planner.world import World
from lazytrain_hf.training import planning
from lazytrain_hf.training.world_links import LINK_KEYS, measure_links

NBYTES = 1 << 20
DELAY_S = 0.25


def _rank_main(rank: int, world_size: int, nodes: int, store: str, out: str, delay_rank: int) -> None:
    import time

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        if rank == delay_rank:  # a slow link seen by one rank only: every rank must report it
            real = dist.reduce

            def slow_reduce(*args, **kwargs):
                time.sleep(DELAY_S)
                return real(*args, **kwargs)

            dist.reduce = slow_reduce
        err = None
        try:
            measure_links(World(world_size + 1, 1), "cpu")
        except ValueError as e:
            err = str(e)
        links = measure_links(World(world_size, nodes), "cpu", nbytes=NBYTES, repeats=2)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"links": links, "err": err}, f)
    finally:
        dist.destroy_process_group()


def _measure(tmp_path, world_size: int, nodes: int, delay_rank: int = -1) -> list[dict]:
    import torch.multiprocessing as mp

    out = tmp_path / f"w{world_size}n{nodes}d{delay_rank}"
    out.mkdir()
    mp.start_processes(
        _rank_main,
        args=(world_size, nodes, str(out / "store"), str(out), delay_rank),
        nprocs=world_size,
        start_method="spawn",
        join=True,
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def test_two_ranks_of_one_node_measure_the_host_and_device_reduce_alike(tmp_path):
    results = _measure(tmp_path, 2, 1)
    assert results[0]["links"] == results[1]["links"]  # the slowest rank's figures, on every rank
    links = results[0]["links"]
    assert sorted(links) == ["device_net_gbps", "shm_gbps"]  # one node: no link between nodes to measure
    for k, v in links.items():
        assert math.isfinite(v) and v > NBYTES / DELAY_S / 1e9, (k, v)  # loopback gloo moves 1 MiB in < 0.25 s
    assert "the world has 3 ranks, the process group 2" in results[0]["err"]


def test_a_rank_that_sees_a_slow_link_sets_every_ranks_figure(tmp_path):
    """Each timed reduce includes the delay on rank 1: the figures are at most 1 MiB per 0.25 s, on rank 0 too."""
    results = _measure(tmp_path, 2, 1, delay_rank=1)
    assert results[0]["links"] == results[1]["links"]
    for k, v in results[0]["links"].items():
        assert 0 < v <= NBYTES / DELAY_S / 1e9, (k, v)


def test_two_nodes_of_two_ranks_measure_the_link_between_the_nodes_too(tmp_path):
    results = _measure(tmp_path, 4, 2)
    links = results[0]["links"]
    assert all(r["links"] == links for r in results)
    assert sorted(links) == sorted(LINK_KEYS)
    assert all(math.isfinite(v) and v > 0 for v in links.values())


def test_measure_links_refuses_bad_input():
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
        measure_links(World(2, 1), "cpu")


def test_rank_zero_plans_with_the_measured_links_of_an_auto_profile(tmp_path):
    """`make_plan` with ``planner_hardware="auto"`` (the profile cached in output_dir, so nothing is timed here)
    takes the links given; a bundled profile keeps its own."""
    from trainer_fixtures import make_trainer

    from lazytrain_hf.planner import hardware

    links = {"shm_gbps": 3.25, "device_net_gbps": 7.5}
    out = tmp_path / "auto"
    out.mkdir()
    cached = hardware.get_profile("cpu")
    cached.to_json(str(out / planning.PROFILE_FILE))
    tr = make_trainer(out, max_steps=1, planner_policy="milp", planner_hardware="auto", planner_warmup_steps=0)
    _, cm = planning.make_plan(tr.model, tr.args, tr._sample_batch(), links)
    assert (cm.hardware.shm_gbps, cm.hardware.device_net_gbps) == (3.25, 7.5)
    assert cm.hardware.net_gbps == cached.net_gbps  # not measured: the profile's
    assert "links measured by the data-parallel world: device_net_gbps=7.5, shm_gbps=3.25" in cm.hardware.source
    tr = make_trainer(tmp_path / "named", max_steps=1, planner_policy="milp", planner_warmup_steps=0)
    _, cm = planning.make_plan(tr.model, tr.args, tr._sample_batch(), links)
    assert (cm.hardware.shm_gbps, cm.hardware.device_net_gbps) == (cached.shm_gbps, cached.device_net_gbps)
    with pytest.raises(ValueError, match="shm_gbps=-1.0 must be a positive finite number"):
        planning.with_world_links(cached, {"shm_gbps": -1.0})


def test_one_process_measures_nothing(tmp_path):
    from trainer_fixtures import make_trainer

    tr = make_trainer(tmp_path, max_steps=1, planner_policy="milp", planner_hardware="auto")
    assert planning.measure_world_links(tr.args) is None


def test_rank_zero_solves_the_milp_for_its_world(tmp_path, monkeypatch):
    """In data parallel rank 0's MILP plans for the world (a rank's optimizer times, `worldcost.for_world`; the world
    recorded in the plan), not for one process: the world reaches `milp.plan_for_model` and the plan says it."""
    from trainer_fixtures import make_trainer

    from lazytrain_hf.planner import milp

    seen = []
    real = milp.plan_for_model

    def spy(*args, **kwargs):
        seen.append(kwargs.get("world"))
        return real(*args, **kwargs)

    monkeypatch.setattr(milp, "plan_for_model", spy)
    monkeypatch.setattr(planning, "world_of", lambda args: World(2, 1))
    tr = make_trainer(tmp_path, max_steps=1, planner_policy="milp", planner_warmup_steps=0)
    plan, _ = planning.make_plan(tr.model, tr.args, tr._sample_batch())
    assert seen == [World(2, 1)]
    assert (plan.world_size, plan.nodes) == (2, 1) and "net" in plan.predicted["bytes_per_step"]
