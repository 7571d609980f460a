"""Data parallel through torch.distributed (gloo on CPU): each layer's host fp32 gradient accumulator is all-reduced
once per optimizer step, after the last micro-batch's addition (Note: [Data parallel reduces the host accumulators
once per step] in lazytrain_hf/streaming/gradients.py); parameters stay identical across ranks and match one
process at the global batch.

This file is also the body of its gradient-accumulation test: ``torchrun ... tests/test_trainer_ddp.py --worker``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.dp_launch import HELPERS, run_ranks, run_two_nodes
from helpers.dp_launch import env as _env
from safetensors.torch import load_file

SCRIPT = os.path.join(HELPERS, "ddp_train.py")
# One process sums the 4 sequences' gradients in one matmul; two processes sum 2 + 2 and all-reduce: fp32 summation
# order differs (~1e-7 relative), which the 8-bit moment rounding can amplify to one quantisation step of m or v.
ATOL, RTOL = 2e-5, 1e-4


@pytest.mark.parametrize("policy", ["milp"])
def test_two_processes_match_each_other_and_one_process(tmp_path, policy):
    ddp = tmp_path / "ddp"
    proc = run_ranks(SCRIPT, ddp, 2, "--per-device-batch", "2", "--policy", policy, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Note: [One plan for every rank]: rank 0 plans, rank 1 executes the broadcast plan
    assert (ddp / "rank0.planned").read_text() == "1" and (ddp / "rank1.planned").read_text() == "0"
    assert (ddp / "rank0.plan.json").read_text() == (ddp / "rank1.plan.json").read_text()
    r0, r1 = load_file(ddp / "rank0.safetensors"), load_file(ddp / "rank1.safetensors")
    for k in r0:
        assert torch.equal(r0[k], r1[k]), f"{k} differs across ranks"

    single = tmp_path / "single"
    proc = run_ranks(SCRIPT, single, 1, "--per-device-batch", "4", "--policy", policy, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref = load_file(single / "rank0.safetensors")
    initial = None
    for k in ref:
        torch.testing.assert_close(r0[k], ref[k], atol=ATOL, rtol=RTOL, msg=k)
    # and training moved the weights (the comparison is not between two untouched models)
    from conftest import tiny_model

    initial = tiny_model("qwen3", seed=1).state_dict()
    assert any(not torch.allclose(ref[k], initial[k]) for k in ref)


# --------------------------------------------------------------------------- the training state partitioned by unit
def _launch(out, nproc: int, *args: str, timeout: int = 900) -> list[dict]:
    """Run tests/helpers/ddp_train.py on ``nproc`` ranks (one plain process for 1) and return each rank's stats."""
    proc = run_ranks(SCRIPT, out, nproc, *args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.stats.json").read_text()) for r in range(nproc)]


def _state_bytes(stats: dict) -> int:
    """Host bytes of the streamed units' training state on one rank: fp32 masters, gradient accumulators, moments."""
    return stats["master_bytes"] + stats["grad_bytes"] + stats["moment_bytes"]


def test_each_rank_holds_and_updates_only_its_partition(tmp_path):
    """Note: [The training state is partitioned by unit] (planner/world.py): on 2 ranks each rank holds the masters,
    8-bit moments and gradient accumulators of its own units only (the two ranks' bytes add up to one process's,
    each about half), and its optimizer updates exactly those units; together they update every unit once."""
    single = _launch(tmp_path / "single", 1, "--per-device-batch", "4")[0]
    ranks = _launch(tmp_path / "ddp", 2, "--per-device-batch", "2")
    total = _state_bytes(single)
    per_rank = [_state_bytes(s) for s in ranks]
    print(f"streamed training state bytes: 1 rank {total}, 2 ranks {per_rank}")
    print(f"updated units: 1 rank {single['updated_units']}, 2 ranks {[s['updated_units'] for s in ranks]}")
    assert total > 0 and single["updated_units"] == single["units"]
    assert sum(per_rank) == total, per_rank
    assert all(b <= 0.55 * total for b in per_rank), per_rank  # 4 equal layers: 2 each
    updated = [set(s["updated_units"]) for s in ranks]
    assert updated[0].isdisjoint(updated[1]) and updated[0] | updated[1] == set(single["units"]), updated
    assert all(len(u) == 2 for u in updated), updated
    # Note: [The node's compute copy is shared by its ranks]: every unit's compute copy in the node's segment, once
    for s in ranks:
        assert s["compute_in_node_copy"] and s["node_copy_bytes"] >= single["compute_bytes"], s
    # Note: [Parameters given back share the node copy]: the trained model given back to every rank is the node's one
    # copy, read-only shared (copy-on-write), not one more copy of the whole model in each rank's own memory
    print(f"streamed parameters given back: 1 rank {single['given_back']}, 2 ranks {[s['given_back'] for s in ranks]}")
    model_bytes = single["given_back"]["own"]
    assert model_bytes > 0 and single["given_back"]["node copy"] == 0
    for s in ranks:
        assert s["given_back"] == {"node copy": model_bytes, "own": 0, "node copy written": 0}, s["given_back"]
    # fp32: the masters are the compute copy, in the node copy (Note: [Compute copy aliases the fp32 master]): no
    # segment of masters
    assert all(s["masters_in_segment"] == {} for s in ranks)
    # the trace's lane "net": per step, the fp32 gradients of the units a rank does not own (the accumulator bytes it
    # does not hold) sent to their owners; nothing gathered from another node on one node
    assert single["net"] == [{}] * 3
    for s in ranks:
        assert s["net"] == [{"reduce": single["grad_bytes"] - s["grad_bytes"]}] * 3, s["net"]
    # Note: [The trace is the planner's referee]: each rank's trace, every lane (net included), equals the bytes the
    # plan predicts for that rank of its world (planner/schedule.py, world and rank), and the plan records the world
    for r, s in enumerate([single, *ranks]):
        plan = json.loads(((tmp_path / "single") if r == 0 else (tmp_path / "ddp")).joinpath(
            f"rank{max(0, r - 1)}.plan.json").read_text())
        assert (plan["world_size"], plan["nodes"]) == ((1, 1) if r == 0 else (2, 1))
        predicted = plan["predicted"]["bytes_per_step"]
        assert s["trace_bytes"] and all(b == predicted for b in s["trace_bytes"]), (s["trace_bytes"], predicted)
        assert (predicted["net"] > 0) == (r > 0)


def _match_one_process(
    tmp_path, nproc: int, *args: str, global_batch: int = 4, atol=ATOL, rtol=RTOL, loss_rtol=None
) -> tuple[dict, list[dict]]:
    """``nproc`` ranks and one process at the same global batch: every rank ends with the same weights, bit for bit,
    equal to the one process's within ``atol`` / ``rtol``, the same losses within ``loss_rtol`` (LOSS_RTOL);
    returns the stats."""
    single = _launch(tmp_path / "single", 1, "--per-device-batch", str(global_batch), *args)[0]
    ranks = _launch(tmp_path / "ddp", nproc, "--per-device-batch", str(global_batch // nproc), *args)
    ref = load_file(tmp_path / "single" / "rank0.safetensors")
    got = [load_file(tmp_path / "ddp" / f"rank{r}.safetensors") for r in range(nproc)]
    for r in range(1, nproc):
        for k in got[0]:
            assert torch.equal(got[0][k], got[r][k]), f"{k} differs between rank 0 and rank {r}"
    for k in ref:
        d = (got[0][k] - ref[k]).abs().max().item()
        torch.testing.assert_close(got[0][k], ref[k], atol=atol, rtol=rtol, msg=f"{k}: max abs difference {d}")
    assert ranks[0]["losses"] == pytest.approx(single["losses"], rel=loss_rtol or LOSS_RTOL)
    updated = [set(s["updated_units"]) for s in ranks]
    assert set().union(*updated) == set(single["updated_units"]) == set(single["units"])
    assert sum(len(u) for u in updated) == len(single["units"])  # each unit updated by one rank
    assert sum(_state_bytes(s) for s in ranks) == _state_bytes(single)
    return single, ranks


@pytest.mark.slow
def test_partitioned_state_on_nvme_matches_one_process(tmp_path):
    """The state on NVMe (state_nvme_dir, every unit): each rank's state files hold only the units it owns; losses
    and weights as one process at the global batch."""
    nvme = tmp_path / "nvme"
    single, ranks = _match_one_process(tmp_path, 2, "--state-nvme", str(nvme))
    assert single["nvme_units"] == single["units"]
    for r, s in enumerate(ranks):
        assert s["nvme_units"] == s["updated_units"], s  # its own units, all of them, on NVMe
        # Note: [The state on NVMe works partitioned]: it reads its own units' state only, as predicted
        predicted = json.loads((tmp_path / "ddp" / f"rank{r}.plan.json").read_text())["predicted"]["bytes_per_step"]
        assert all(b == predicted for b in s["trace_bytes"]), (s["trace_bytes"], predicted)
        assert {int(k.rsplit(" ", 1)[1]) for k in s["nvme_read"][0]} == set(s["nvme_units"])


@pytest.mark.slow
def test_partitioned_moe_with_streamed_embeddings_matches_one_process(tmp_path):
    """A MoE model (tiny qwen3_moe: experts no local token reached take part in the reduce with zeros) with the
    embedding and the head streamed as units (unit order: embedding, layers, head), gradient accumulation 2."""
    single, ranks = _match_one_process(
        tmp_path, 2, "--model-type", "qwen3_moe", "--stream-embeddings", "--ga", "2"
    )
    assert -1 in single["units"] and 4 in single["units"]  # the embedding and the head units
    for s in ranks:  # gradient accumulation 2: the non-owned units' gradients cross twice per step
        assert s["net"] == [{"reduce": 2 * (single["grad_bytes"] - s["grad_bytes"])}] * 3, s["net"]


@pytest.mark.slow
def test_partitioned_bf16_compute_copy_gives_every_rank_the_fp32_masters(tmp_path):
    """bf16=True on an fp32 model: the compute copy a rank receives for a unit it does not own is bf16, its fp32 master
    lives on the owner; after train() every rank's model holds every unit's fp32 master (gathered before the
    executor is removed), bit for bit the same on every rank.

    Against one process the tolerance is bf16's, not fp32's: each rank's forward and backward run in bf16 on half the
    batch, so gradients differ from one process's by bf16 roundings (2^-8 relative), and AdamW turns a gradient
    difference near zero into up to a whole step of ``lr`` per step: ``atol = steps x lr = 3e-3`` (measured: 2.0e-3,
    losses within 3e-5 relative; the weights are bit for bit those of the replicated-state data parallel of before
    the partitioning, compared by hand)."""
    single, ranks = _match_one_process(tmp_path, 2, "--bf16", atol=3e-3, rtol=0.0, loss_rtol=1e-4)
    got = load_file(tmp_path / "ddp" / "rank0.safetensors")
    assert all(v.dtype == torch.float32 for v in got.values())
    # the masters, not their bf16 rounding: some trained weight is not a bf16 value
    w = got["model.layers.1.self_attn.q_proj.weight"]
    assert not torch.equal(w, w.to(torch.bfloat16).float())
    # Note: [Masters live in the node's segment] (training/dataparallel.py): the fp32 model given back to
    # every rank is one copy per node, read through copy-on-write mappings, not a whole fp32 model in each rank's
    # own memory (N copies per node at the end of train())
    print(f"streamed parameters given back: 1 rank {single['given_back']}, 2 ranks {[s['given_back'] for s in ranks]}")
    model_bytes = single["given_back"]["own"]
    assert model_bytes > 0 and single["given_back"]["node copy"] == 0
    for s in ranks:
        assert s["given_back"] == {"node copy": model_bytes, "own": 0, "node copy written": 0}, s["given_back"]
    # Note: [Masters live in the node's segment]: the owner's masters are in that segment while training too, so
    # giving them back copies nothing and the node never holds them twice (in a rank's memory and in the segment)
    for s in ranks:
        assert s["masters_in_segment"] and all(s["masters_in_segment"].values()), s["masters_in_segment"]
    assert sorted(k for s in ranks for k in s["masters_in_segment"]) == sorted(str(u) for u in single["units"])


@pytest.mark.slow
def test_two_nodes_gather_the_units_owned_on_the_other_node(tmp_path):
    """Two ``torch.distributed.run --nnodes 2`` launches on localhost, one rank each: each node has its own node
    copy; a unit owned on the other node arrives by a broadcast in the local-rank group and is recorded on the lane
    ``net`` as ``gather`` (its compute-copy bytes, once per step); weights and losses as one process."""
    out = tmp_path / "ddp"
    launches = run_two_nodes(SCRIPT, "--out", str(out), "--per-device-batch", "2")
    assert [rc for rc, _ in launches] == [0, 0], "\n".join(log[-3000:] for _, log in launches)
    ranks = [json.loads((out / f"rank{r}.stats.json").read_text()) for r in range(2)]
    single = _launch(tmp_path / "single", 1, "--per-device-batch", "4")[0]
    ref = load_file(tmp_path / "single" / "rank0.safetensors")
    got = [load_file(out / f"rank{r}.safetensors") for r in range(2)]
    for k in ref:
        assert torch.equal(got[0][k], got[1][k]), k
        torch.testing.assert_close(got[0][k], ref[k], atol=ATOL, rtol=RTOL, msg=k)
    assert ranks[0]["losses"] == pytest.approx(single["losses"], rel=LOSS_RTOL)
    per_unit = single["compute_bytes"] // len(single["units"])  # the tiny qwen3's 4 equal layers
    for s in ranks:
        remote = len(s["units"]) - len(s["updated_units"])
        assert s["net"] == [{"reduce": single["grad_bytes"] - s["grad_bytes"], "gather": remote * per_unit}] * 3


@pytest.mark.slow
def test_two_nodes_with_a_bf16_compute_copy_give_back_the_masters_from_each_nodes_segment(tmp_path):
    """Two nodes (one rank each), bf16 compute copy: a unit's fp32 masters reach the other node by a broadcast in
    the local-rank group, written into that node's segment (Note: [Masters live in the node's segment]);
    both ranks give back the same fp32 model, from their node's segment, equal to one process's within bf16's
    tolerance (`test_partitioned_bf16_compute_copy_gives_every_rank_the_fp32_masters`)."""
    out = tmp_path / "ddp"
    launches = run_two_nodes(SCRIPT, "--out", str(out), "--per-device-batch", "2", "--bf16")
    assert [rc for rc, _ in launches] == [0, 0], "\n".join(log[-3000:] for _, log in launches)
    ranks = [json.loads((out / f"rank{r}.stats.json").read_text()) for r in range(2)]
    single = _launch(tmp_path / "single", 1, "--per-device-batch", "4", "--bf16")[0]
    ref = load_file(tmp_path / "single" / "rank0.safetensors")
    got = [load_file(out / f"rank{r}.safetensors") for r in range(2)]
    for k in ref:
        assert got[0][k].dtype == torch.float32 and torch.equal(got[0][k], got[1][k]), k
        torch.testing.assert_close(got[0][k], ref[k], atol=3e-3, rtol=0.0, msg=k)
    model_bytes = single["given_back"]["own"]
    for s in ranks:
        assert s["given_back"] == {"node copy": model_bytes, "own": 0, "node copy written": 0}, s["given_back"]
    # Note: [Masters live in the node's segment]: the owner's masters are in that segment while training too, so
    # giving them back copies nothing and the node never holds them twice (in a rank's memory and in the segment)
    for s in ranks:
        assert s["masters_in_segment"] and all(s["masters_in_segment"].values()), s["masters_in_segment"]
    assert sorted(k for s in ranks for k in s["masters_in_segment"]) == sorted(str(u) for u in single["units"])


@pytest.mark.slow
def test_four_ranks_hold_a_quarter_each_and_match_one_process(tmp_path):
    """4 ranks x 1 sequence against one process x 4: a quarter of the training state and one unit updated per rank
    (the tiny qwen3's 4 equal decoder layers), weights and losses as one process."""
    single, ranks = _match_one_process(tmp_path, 4)
    per_rank = [_state_bytes(s) for s in ranks]
    print(f"streamed training state bytes: 1 rank {_state_bytes(single)}, 4 ranks {per_rank}")
    assert all(4 * b == _state_bytes(single) for b in per_rank), per_rank
    assert [s["updated_units"] for s in ranks] == [[0], [1], [2], [3]]


# --------------------------------------------------------------------------- gradients reduced on the device
def _check_device_reduce(tmp_path, single: dict, ranks: list[dict]) -> None:
    """Note: [Gradients reduced on the device skip the other ranks' D2H]: every rank's plan says ``device``; a rank
    copies D2H the gradients of its own units only (as many bytes per unit as one process), none of the others',
    and records on ``net`` one ``reduce_device`` per micro-batch of each unit it does not own (that unit's gradient
    bytes); its trace equals the bytes its plan predicts for its rank, every lane."""
    for r, s in enumerate(ranks):
        plan = json.loads((tmp_path / "ddp" / f"rank{r}.plan.json").read_text())
        assert plan["dp_reduce"] == "device" and plan["world_size"] == 2
        predicted = plan["predicted"]["bytes_per_step"]
        assert all(b == predicted for b in s["trace_bytes"]), (s["trace_bytes"], predicted)
        own = {str(k) for k in s["updated_units"]}
        others = {str(k) for k in s["units"]} - own
        assert own and others
        remote_bytes = 0
        for step, one in zip(s["d2h_grad"], single["d2h_grad"]):
            assert set(step) == own, (r, step)  # 0 D2H bytes for the units another rank owns
            assert all(step[k] == one[k] for k in own), (step, one)
            remote_bytes = sum(one[k] for k in others)
        assert s["net"] == [{"reduce_device": remote_bytes}] * 3, s["net"]
        assert predicted["d2h"] == sum(s["d2h_grad"][0].values()) and predicted["net"] == remote_bytes


@pytest.mark.slow
def test_device_reduce_matches_one_process_and_its_prediction(tmp_path):
    """dp_reduce="device" on 2 ranks (gloo on the CPU device's tensors, the path NCCL takes on CUDA), gradient
    accumulation 2: weights and losses as one process at the same global batch within the tolerances of the host
    path (the summation order differs as there: 2 + 2 sequences, then the sum on the device); each rank's trace is
    its prediction, with no D2H of the units it does not own."""
    single, ranks = _match_one_process(tmp_path, 2, "--dp-reduce", "device", "--ga", "2", global_batch=4)
    _check_device_reduce(tmp_path, single, ranks)


@pytest.mark.slow
def test_device_reduce_without_accumulation_matches_one_process(tmp_path):
    """The same without gradient accumulation: the owner's norm is taken on the device, of the reduced gradient."""
    single, ranks = _match_one_process(tmp_path, 2, "--dp-reduce", "device")
    _check_device_reduce(tmp_path, single, ranks)


@pytest.mark.slow
def test_device_reduce_of_moe_units_with_streamed_embeddings_matches_one_process(tmp_path):
    """The device reduce of a MoE model (experts no local token reached take part with zeros) whose embedding and
    head are units too, gradient accumulation 2."""
    single, ranks = _match_one_process(
        tmp_path, 2, "--dp-reduce", "device", "--model-type", "qwen3_moe", "--stream-embeddings", "--ga", "2"
    )
    assert -1 in single["units"] and 4 in single["units"]
    _check_device_reduce(tmp_path, single, ranks)


# --------------------------------------------------------------------------- gradients reduced once per step
@pytest.mark.slow
def test_step_reduce_with_accumulation_matches_one_process_and_its_prediction(tmp_path):
    """Note: [Gradients reduced once per step]: 2 ranks, gradient accumulation 2, the host reduce once per step
    (``planner_dp_reduce_every="step"``): weights and losses as one process at the same global batch within the
    data-parallel tolerances (not bit for bit: each rank sums its 2 micro-batches first, then the ranks are summed,
    where the per-micro-batch reduce sums the ranks first); every unit reduced once per step; each rank's ``net``
    lane carries the fp32 gradients of the units it does not own once per step, half of what the per-micro-batch
    reduce of the same run moves, and every lane of its trace equals its plan's prediction."""
    single, ranks = _match_one_process(
        tmp_path, 2, "--dp-reduce", "host", "--dp-reduce-every", "step", "--ga", "2", global_batch=4
    )
    per_mb = _launch(tmp_path / "ddp_mb", 2, "--per-device-batch", "2", "--dp-reduce", "host",
                     "--dp-reduce-every", "micro_batch", "--ga", "2")
    ref = load_file(tmp_path / "single" / "rank0.safetensors")
    for mode, out in (("step", "ddp"), ("micro_batch", "ddp_mb")):
        got = load_file(tmp_path / out / "rank0.safetensors")
        diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
        losses = json.loads((tmp_path / out / "rank0.stats.json").read_text())["losses"]
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, single["losses"]))
        print(f"dp_reduce_every={mode}: max |w - w_one_process| {diff:.3g}, max loss rel. diff {rel:.3g}")
    for r, (s, mb) in enumerate(zip(ranks, per_mb)):
        plan = json.loads((tmp_path / "ddp" / f"rank{r}.plan.json").read_text())
        assert (plan["dp_reduce"], plan["dp_reduce_every"], plan["world_size"]) == ("host", "step", 2)
        predicted = plan["predicted"]["bytes_per_step"]
        assert all(b == predicted for b in s["trace_bytes"]), (s["trace_bytes"], predicted)
        remote = single["grad_bytes"] - s["grad_bytes"]  # the accumulators this rank does not own
        assert remote > 0 and predicted["net"] == remote
        assert s["net"] == [{"reduce": remote}] * 3, s["net"]
        assert mb["net"] == [{"reduce": 2 * remote}] * 3, mb["net"]  # every micro-batch: twice the bytes
        mb_plan = json.loads((tmp_path / "ddp_mb" / f"rank{r}.plan.json").read_text())
        assert all(b == mb_plan["predicted"]["bytes_per_step"] for b in mb["trace_bytes"])
        assert s["reductions"] == {str(k): 3 for k in s["units"]}, s["reductions"]  # 3 steps, once each
        assert mb["reductions"] == {str(k): 6 for k in s["units"]}, mb["reductions"]
        print(f"rank {r}: net bytes per step: step {s['net'][0]['reduce']}, micro_batch {mb['net'][0]['reduce']}")


@pytest.mark.slow
def test_step_reduce_of_moe_units_with_streamed_embeddings_and_state_on_nvme_matches_one_process(tmp_path):
    """Reduced once per step, GA 2: a MoE model (experts no local token reached take part with zeros, zeroed on
    the first micro-batch only) whose embedding and head are units too (the tied embedding completes once, after
    both uses), every unit's state on NVMe (the owner's gradient windows; a non-owner's accumulators in RAM)."""
    single, ranks = _match_one_process(
        tmp_path, 2, "--dp-reduce-every", "step", "--model-type", "qwen3_moe", "--stream-embeddings", "--ga", "2",
        "--state-nvme", str(tmp_path / "nvme"),
    )
    assert -1 in single["units"] and 4 in single["units"]
    for r, s in enumerate(ranks):
        plan = json.loads((tmp_path / "ddp" / f"rank{r}.plan.json").read_text())
        assert plan["dp_reduce_every"] == "step"
        # every lane equals the prediction, nvme_read too (Note: [The state on NVMe works partitioned])
        predicted = plan["predicted"]["bytes_per_step"]
        assert all(b == predicted for b in s["trace_bytes"]), (s["trace_bytes"], predicted)
        assert {int(k.rsplit(" ", 1)[1]) for k in s["nvme_read"][0]} == set(s["nvme_units"]) == set(s["updated_units"])
        print(f"rank {r}: nvme_read per step {predicted['nvme_read']}: {s['nvme_read'][0]}")
        assert s["net"] == [{"reduce": single["grad_bytes"] - s["grad_bytes"]}] * 3, s["net"]
        assert s["reductions"] == {str(k): 3 for k in s["units"]}, s["reductions"]


@pytest.mark.slow
def test_rank_zero_plans_with_the_links_every_rank_measured(tmp_path):
    """Note: [The world's links are measured]: with ``planner_hardware="auto"`` (the profile cached in output_dir,
    so only the links are timed) both ranks measure the same link figures before rank 0 plans, and rank 0's cost
    model carries them (the link between nodes, not measured on one node, stays the profile's)."""
    from lazytrain_hf.planner import hardware
    from lazytrain_hf.training.planning import PROFILE_FILE

    ddp = tmp_path / "ddp"
    (ddp / "run").mkdir(parents=True)
    cpu = hardware.get_profile("cpu")
    cpu.to_json(str(ddp / "run" / PROFILE_FILE))
    stats = _launch(ddp, 2, "--per-device-batch", "2", "--policy", "milp", "--hardware", "auto")
    links = stats[0]["world_links"]
    print(f"measured links: {links}")
    assert stats[1]["world_links"] == links and sorted(links) == ["device_net_gbps", "shm_gbps"]
    assert {k: stats[0]["planned_links"][k] for k in links} == links
    assert stats[0]["planned_links"]["net_gbps"] == cpu.net_gbps
    assert "planned_links" not in stats[1]  # rank 1 executes the plan it received


# --------------------------------------------------------------------------- gradient accumulation, reductions counted
# Two ranks x 2 sequences x GA 2 and one process x 4 sequences x GA 2 see the same 8 sequences per optimizer step
# (accelerate hands rank r every r-th batch of the same sampler order). Tolerances as above: the summation order of
# the fp32 gradients differs (4 sequences per matmul vs 2, then the fp32 host reduction, per micro-batch into the
# owner's accumulator), amplified at most to one quantisation step of the 8-bit moments; losses within rel 1e-5.
LOSS_RTOL = 1e-5


def _worker(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--per-device-batch", type=int, default=2)
    p.add_argument("--ga", type=int, default=2)
    p.add_argument("--dp-reduce-every", default="micro_batch")  # "auto": the planner decides (it may pick "step")
    a = p.parse_args(argv)
    from safetensors.torch import save_file
    from trainer_fixtures import make_trainer
    from transformers import TrainerCallback

    rank = int(os.environ.get("RANK", "0"))
    trainer = make_trainer(
        os.path.join(a.out, "run"),
        max_steps=3,
        per_device_train_batch_size=a.per_device_batch,
        gradient_accumulation_steps=a.ga,
        planner_policy="keep_all",
        dataloader_drop_last=True,
        planner_dp_reduce_every=a.dp_reduce_every,
    )
    step_counts: list[dict[str, int]] = []
    seen: dict[str, int] = {}

    class CountPerStep(TrainerCallback):
        # the data-parallel collectives of each optimizer step: gradient reduces per unit ("-1": the resident
        # parameters' all-reduce) and compute copies received per unit
        def on_step_end(self, args, state, control, **kwargs):
            dp, now = trainer._dp, {}
            if dp is not None:
                trainer._updater.wait_all()  # an overlapped update has received every unit
                now = {str(k): v for k, v in dp.reductions.items()} | {"-1": dp.resident_reductions}
                now.update({f"recv{k}": v for k, v in dp.received.items()})
            step_counts.append({k: v - seen.get(k, 0) for k, v in now.items() if v - seen.get(k, 0)})
            seen.update(now)

    trainer.add_callback(CountPerStep())
    trainer.train()
    state = {k: v.detach().contiguous().clone() for k, v in trainer.model.state_dict().items()}
    save_file(state, os.path.join(a.out, f"rank{rank}.safetensors"))
    plan = trainer.lazy_plan
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "losses": trainer.loss_recorder.losses,
                "reductions": step_counts,
                "dp_reduce": [plan.dp_reduce, plan.dp_reduce_every],
                "dp_reduce_step_s": plan.predicted.get("dp_reduce_step_s"),
            },
            f,
        )


@pytest.mark.slow
def test_gradient_accumulation_reduces_to_the_owner_every_micro_batch(tmp_path):
    """GA 2 on 2 ranks (Note: [Partitioned gradients are reduced to their owner every micro-batch]), the cadence
    forced (``planner_dp_reduce_every="micro_batch"``): every unit's
    gradient is reduced to its owner once per micro-batch (a non-owner has no accumulator), the resident parameters
    all-reduced once per optimizer step, and each rank receives the compute copy of each unit it does not own once
    per step; losses and weights equal one process at the global batch within the tolerances."""
    ddp = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--worker", "--out", str(ddp), "--per-device-batch", "2", "--ga", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = load_file(ddp / "rank0.safetensors"), load_file(ddp / "rank1.safetensors")
    for k in r0:
        assert torch.equal(r0[k], r1[k]), f"{k} differs across ranks"
    for rank, remote in ((0, ("1", "3")), (1, ("0", "2"))):
        info = json.loads((ddp / f"rank{rank}.json").read_text())
        assert len(info["reductions"]) == 3
        for counts in info["reductions"]:
            # the tiny qwen3's 4 decoder layers, all streamed, dealt round-robin (planner/world.py unit_owners)
            want = {str(i): 2 for i in range(4)} | {"-1": 1} | {f"recv{i}": 1 for i in remote}
            assert counts == want, counts

    single = tmp_path / "single"
    cmd = [sys.executable, __file__, "--worker", "--out", str(single), "--per-device-batch", "4", "--ga", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref = load_file(single / "rank0.safetensors")
    ref_info = json.loads((single / "rank0.json").read_text())
    assert ref_info["reductions"] == [{}, {}, {}]  # one process: nothing to reduce
    info = json.loads((ddp / "rank0.json").read_text())
    assert info["losses"] == pytest.approx(ref_info["losses"], rel=LOSS_RTOL)
    for k in ref:
        torch.testing.assert_close(r0[k], ref[k], atol=ATOL, rtol=RTOL, msg=k)
    from conftest import tiny_model

    initial = tiny_model("qwen3", seed=1).state_dict()
    assert any(not torch.allclose(ref[k], initial[k]) for k in ref)


@pytest.mark.slow
def test_planner_chosen_cadence_is_what_the_ranks_run(tmp_path):
    """``planner_dp_reduce_every="auto"`` with GA 2 on 2 ranks (the MILP plan of rank 0 on this machine's measured
    profile): both ranks run the plan's choice (Note: [Gradients reduced once per step]), its simulated steps
    recorded; each unit is reduced once per step with "step", once per micro-batch otherwise, and the ranks end
    bit-equal."""
    ddp = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--worker", "--out", str(ddp), "--per-device-batch", "2", "--ga", "2", "--dp-reduce-every", "auto"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    infos = [json.loads((ddp / f"rank{r}.json").read_text()) for r in range(2)]
    mode, every = infos[0]["dp_reduce"]
    steps = infos[0]["dp_reduce_step_s"]
    print(f"planner: dp_reduce={mode}, dp_reduce_every={every}, simulated steps {steps}")
    assert infos[1]["dp_reduce"] == [mode, every] and set(steps) >= {"host", "host/step"}
    assert steps[mode if every == "micro_batch" else f"{mode}/{every}"] == min(steps.values())
    per_step = 1 if every == "step" else 2
    for info in infos:
        assert all({k: v for k, v in c.items() if k.isdigit()} == {str(i): per_step for i in range(4)}
                   for c in info["reductions"]), info["reductions"]
    r0, r1 = load_file(ddp / "rank0.safetensors"), load_file(ddp / "rank1.safetensors")
    assert all(torch.equal(r0[k], r1[k]) for k in r0)


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.argv.remove("--worker")
    _worker(sys.argv[1:])
