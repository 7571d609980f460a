"""Checkpoints and resume of a training state partitioned by unit across data-parallel ranks (Note: [A checkpoint of
a partitioned state] in lazytrain_hf/training/partition_files.py), and ranks that die mid-step or mid-save (Note: [A
failed rank is named] in lazytrain_hf/training/partitions.py), and the ranks' timeout (Note: [One timeout for the
ranks' collectives], same module). Each launch runs tests/helpers/dp_checkpoint.py with `torch.distributed.run
--standalone`, as two `--nnodes 2` launches on localhost, or as one process (tests/helpers/dp_launch.py; gloo on CPU,
one thread per rank).
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from helpers.dp_launch import HELPERS, env, run_ranks, run_two_nodes
from safetensors import safe_open
from safetensors.torch import load_file

from lazytrain_hf.training.checkpoints import verify_checkpoint
from lazytrain_hf.training.partition_files import layout_name, partition_name

SCRIPT = os.path.join(HELPERS, "dp_checkpoint.py")
# A resume at another world size runs the steps after the checkpoint with another split of the global batch: one
# process sums 4 sequences' gradients in one matmul, two ranks 2 + 2 and a reduce, so the fp32 summation order
# differs (~1e-7 relative) and the 8-bit moments may round one quantisation step apart: the data-parallel tolerances
# of tests/test_trainer_ddp.py. At the same world size every operation repeats in the same order: bit for bit.
ATOL, RTOL = 2e-5, 1e-4
LOSS_RTOL = 1e-5
TIMEOUT_S = 900  # per launch: far above a run's ~1-2 min, so a hang fails instead of blocking the suite


def _launch(out, nproc: int, *args: str, check: bool = True, environ: dict | None = None):
    proc = run_ranks(SCRIPT, out, nproc, *args, environ=environ, timeout=TIMEOUT_S)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return proc


def _result(out, rank: int = 0) -> tuple[dict, dict]:
    return load_file(out / f"rank{rank}.safetensors"), json.loads((out / f"rank{rank}.json").read_text())


def _header(path) -> dict[str, tuple]:
    with safe_open(str(path), framework="pt") as f:
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}


def _report(got: dict, ref: dict, losses: list[float], ref_losses: list[float], what: str) -> None:
    """Print how far a resume at another world size is from the straight run (the figures the tolerances bound)."""
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    differ = sum(not torch.equal(got[k], ref[k]) for k in ref)
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    print(f"{what}: max |w - w_straight| {diff:.3g} ({differ} of {len(ref)} tensors differ), loss rel. diff {rel}")


def _assert_partitioned(ckpt, world: int) -> None:
    for r in range(world):
        assert (ckpt / partition_name(r, world)).exists() and (ckpt / layout_name(r, world)).exists(), r
        layout = json.loads((ckpt / layout_name(r, world)).read_text())
        assert layout["world_size"] == world and layout["rank"] == r
        assert sorted(int(k) for k in layout["units"]) == sorted(int(k) for k, o in layout["owners"].items() if o == r)
        assert layout["states"], "the partition holds its units' moments"
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert opt["lazytrain_partitioned"]["world_size"] == world  # optimizer.pt: the resident parameters only
    names = {n for g in opt["param_groups"] for n in g["param_names"]}
    assert not any(".layers." in n for n in names), names


@pytest.mark.slow  # 35-60 s under load: kept out of CI's default run
def test_same_world_resume_is_bit_exact_and_weights_are_the_trained_model(tmp_path):
    """2 ranks, bf16 compute of the fp32 tiny qwen3 (the saved weights are the fp32 masters, so rank 0 receives the
    masters of rank 1's units): 4 steps straight (checkpoints at 2 and 4) against 2 steps + checkpoint-2 + resume on
    2 ranks for 2 steps: final weights bit-equal, losses equal; checkpoint-4's model.safetensors bit-identical to
    rank 0's model after train(); every partition there with its layout; verify_checkpoint passes."""
    straight = tmp_path / "straight"
    _launch(straight, 2, "--bf16")
    ckpt2, ckpt4 = straight / "run" / "checkpoint-2", straight / "run" / "checkpoint-4"
    for ckpt in (ckpt2, ckpt4):
        _assert_partitioned(ckpt, 2)
        verify_checkpoint(str(ckpt))
    ref, ref_info = _result(straight)
    weights = load_file(ckpt4 / "model.safetensors")
    assert set(weights) <= set(ref) and len(weights) >= len(ref) - 1  # a tied lm_head is saved once
    for k, v in weights.items():
        assert v.dtype == torch.float32 and torch.equal(v, ref[k]), k
    assert not list((straight / "run").glob(".staging-*"))

    resumed = tmp_path / "resumed"
    _launch(resumed, 2, "--bf16", "--resume", str(ckpt2))
    got, info = _result(resumed)
    assert info["global_step"] == 4 and len(info["losses"]) == 2
    assert info["losses"] == ref_info["losses"][2:]
    for k in ref:
        assert torch.equal(got[k], ref[k]), f"{k} differs after the resume"
    got1, _ = _result(resumed, 1)
    for k in ref:
        assert torch.equal(got1[k], ref[k]), f"{k} differs on rank 1"


@pytest.mark.slow
def test_step_reduce_with_accumulation_resumes_bit_exact(tmp_path):
    """Note: [Gradients reduced once per step]: 2 ranks, gradient accumulation 2, gradients reduced once per step.
    A checkpoint is taken at a step boundary, after the step's reduce and update, so no rank's accumulator of a unit
    it does not own holds anything a resume needs (the next micro-batch overwrites it): 4 steps straight against 2
    steps + checkpoint-2 + resume on 2 ranks for 2 steps are bit-equal, and the checkpoint's plan says "step"."""
    flags = ("--ga", "2", "--dp-reduce-every", "step")
    straight = tmp_path / "straight"
    _launch(straight, 2, *flags)
    ckpt2 = straight / "run" / "checkpoint-2"
    _assert_partitioned(ckpt2, 2)
    verify_checkpoint(str(ckpt2))
    assert json.loads((ckpt2 / "lazytrain_plan.json").read_text())["dp_reduce_every"] == "step"
    ref, ref_info = _result(straight)
    resumed = tmp_path / "resumed"
    _launch(resumed, 2, *flags, "--resume", str(ckpt2))
    got, info = _result(resumed)
    assert info["global_step"] == 4 and info["losses"] == ref_info["losses"][2:]
    for k in ref:
        assert torch.equal(got[k], ref[k]), f"{k} differs after the resume"


def test_refusals_name_the_option():
    """What checkpoints of a partitioned state do not support is refused with the option, the value and the fix."""
    from types import SimpleNamespace

    from lazytrain_hf.training.partitions import check_partitioned_args

    args = SimpleNamespace(save_strategy="steps", save_on_each_node=True, world_size=2, ddp_timeout=1800)
    with pytest.raises(ValueError, match="save_on_each_node=True .* set save_on_each_node=False"):
        check_partitioned_args(args, torch.nn.Linear(2, 2))
    args.save_on_each_node = False
    with pytest.raises(ValueError, match="save_strategy='steps' .* Linear .* set save_strategy='no'"):
        check_partitioned_args(args, torch.nn.Linear(2, 2))
    check_partitioned_args(
        SimpleNamespace(save_strategy="no", save_on_each_node=True, world_size=2, ddp_timeout=1800), None
    )


@pytest.fixture
def timeout_default(monkeypatch):
    """The process's data-parallel timeout default (`configure_timeout` sets it) restored after the test, and
    LAZYTRAIN_DP_TIMEOUT_S unset."""
    from lazytrain_hf.streaming import nodecopy

    monkeypatch.setattr(nodecopy, "_default_timeout", nodecopy._default_timeout)
    monkeypatch.delenv(nodecopy.TIMEOUT_ENV, raising=False)
    return monkeypatch


def test_timeout_follows_ddp_timeout(timeout_default):
    """Note: [One timeout for the ranks' collectives]: with LAZYTRAIN_DP_TIMEOUT_S unset, the gloo groups of a
    partitioned run and the node copy's waits time out after TrainingArguments.ddp_timeout, and the messages say
    to raise ddp_timeout; the variable may shorten it (the hung-rank test uses 20 s), never lengthen it."""
    import datetime
    from types import SimpleNamespace

    from lazytrain_hf import LazyTrainingArguments
    from lazytrain_hf.planner.world import World
    from lazytrain_hf.streaming.nodecopy import TIMEOUT_ENV, NodeCopy, WaitTimeoutError, dp_timeout_s
    from lazytrain_hf.training.partitions import check_partitioned_args, configure_timeout, group_timeout

    args = LazyTrainingArguments(output_dir="unused", ddp_timeout=1234, use_cpu=True, report_to=[])
    assert configure_timeout(args) == 1234
    assert dp_timeout_s() == 1234 and group_timeout() == datetime.timedelta(seconds=1234)
    check_partitioned_args(SimpleNamespace(save_strategy="no", save_on_each_node=False, world_size=2,
                                           ddp_timeout=0.25), None)  # fmt: skip
    assert dp_timeout_s() == 0.25  # train() sets it before any group is created
    # a wait for a unit owned on another node that never arrives: after ddp_timeout, naming it
    run_id = f"test-{os.getpid()}-timeout"
    nc = NodeCopy(run_id, World(world_size=2, nodes=2), 0, 4096, 1, lambda: None, pin=False)
    try:
        with pytest.raises(WaitTimeoutError, match=r"waited 0.25 s .* raise ddp_timeout \(seconds, now 0.25\)"):
            nc.wait(0, 1, owner_rank=1)
    finally:
        nc.close()

    timeout_default.setenv(TIMEOUT_ENV, "20")
    assert configure_timeout(args) == 20 and group_timeout() == datetime.timedelta(seconds=20)
    timeout_default.setenv(TIMEOUT_ENV, "3600")
    with pytest.raises(ValueError, match=rf"{TIMEOUT_ENV}=3600 s is longer than ddp_timeout=1234 s: .* Raise "
                                         rf"ddp_timeout to at least 3600, or unset {TIMEOUT_ENV}"):  # fmt: skip
        configure_timeout(args)
    timeout_default.delenv(TIMEOUT_ENV)
    for bad in (0, -5, "soon", True):
        with pytest.raises(ValueError, match=rf"ddp_timeout={bad!r} must be a positive number of seconds"):
            configure_timeout(SimpleNamespace(ddp_timeout=bad))


def test_verify_names_a_missing_partition(tmp_path):
    """verify_checkpoint refuses a checkpoint whose partition of rank 1 is gone (written by 2 ranks)."""
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    layout = {"format": 1, "world_size": 2, "rank": 0, "owners": {"0": 0, "1": 1}, "units": {}, "masters": [],
              "states": [], "steps": {}, "block_size": 256, "unit_order": [0, 1]}  # fmt: skip
    (ckpt / layout_name(0, 2)).write_text(json.dumps(layout))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(ckpt / partition_name(0, 2)))
    with pytest.raises(ValueError, match=r"written by 2 ranks .*lazytrain_partition-00001-of-00002\.safetensors"):
        verify_checkpoint(str(ckpt))
    (ckpt / layout_name(1, 2)).write_text(json.dumps(dict(layout, rank=1)))
    save_file({"x": torch.zeros(1)}, str(ckpt / partition_name(1, 2)))
    verify_checkpoint(str(ckpt))


@pytest.mark.slow
def test_resume_two_ranks_on_one_process(tmp_path):
    """2 -> 1: a checkpoint of 2 ranks resumed on one process (batch 4 = the global batch): each unit's moments
    read by name from the partition that holds them; against the 2-rank straight run within the DP tolerances (fp32
    as in tests/test_trainer_ddp.py: with bf16 compute the split of the batch moves the losses by ~1.2e-5 relative,
    outside LOSS_RTOL)."""
    straight = tmp_path / "straight"
    _launch(straight, 2)
    ref, ref_info = _result(straight)
    one = tmp_path / "one"
    _launch(one, 1, "--per-device-batch", "4", "--resume", str(straight / "run" / "checkpoint-2"))
    got, info = _result(one)
    assert info["global_step"] == 4
    _report(got, ref, info["losses"], ref_info["losses"][2:], "2 -> 1")
    assert info["losses"] == pytest.approx(ref_info["losses"][2:], rel=LOSS_RTOL)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=ATOL, rtol=RTOL, msg=k)


@pytest.mark.slow
def test_resume_one_process_on_two_ranks(tmp_path):
    """1 -> 2: today's one-process checkpoint (complete optimizer.pt, no partitions) resumed on 2 ranks, each taking
    its own units' state by name; its model.safetensors has the keys, dtypes and shapes of the 2-rank checkpoint."""
    straight = tmp_path / "straight"
    _launch(straight, 1, "--per-device-batch", "4")
    ref, ref_info = _result(straight)
    ckpt2 = straight / "run" / "checkpoint-2"
    assert not list(ckpt2.glob("lazytrain_partition-*"))
    two = tmp_path / "two"
    _launch(two, 2, "--resume", str(ckpt2))
    got, info = _result(two)
    assert info["global_step"] == 4
    _report(got, ref, info["losses"], ref_info["losses"][2:], "1 -> 2")
    assert info["losses"] == pytest.approx(ref_info["losses"][2:], rel=LOSS_RTOL)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=ATOL, rtol=RTOL, msg=k)
    # the weights file of a partitioned checkpoint is the one-process file
    two_ckpt = two / "run" / "checkpoint-4"
    _assert_partitioned(two_ckpt, 2)
    assert _header(two_ckpt / "model.safetensors") == _header(straight / "run" / "checkpoint-4" / "model.safetensors")


@pytest.mark.slow
def test_partitioned_state_on_nvme_resumes_bit_exact(tmp_path):
    """The state on NVMe (every unit, state_nvme_dir per run): each rank's partition holds its own units' state read
    from its state files; the resume on 2 ranks (fresh state files) is bit-exact with the straight run."""
    straight = tmp_path / "straight"
    _launch(straight, 2, "--state-nvme", str(tmp_path / "nvme_a"))
    ckpt2 = straight / "run" / "checkpoint-2"
    _assert_partitioned(ckpt2, 2)
    verify_checkpoint(str(ckpt2))
    ref, ref_info = _result(straight)
    resumed = tmp_path / "resumed"
    _launch(resumed, 2, "--state-nvme", str(tmp_path / "nvme_b"), "--resume", str(ckpt2))
    got, info = _result(resumed)
    assert info["losses"] == ref_info["losses"][2:]
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def _launch_two_nodes(out, *args: str) -> None:
    launches = run_two_nodes(SCRIPT, "--out", str(out), *args, timeout=TIMEOUT_S)
    assert [rc for rc, _ in launches] == [0, 0], "\n".join(log[-3000:] for _, log in launches)


@pytest.mark.slow
def test_two_nodes_checkpoint_resumes_bit_exact_and_matches_one_node(tmp_path):
    """Two ``torch.distributed.run --nnodes 2`` launches on localhost, one rank each (each node its own compute copy
    in shared memory; units owned on the other node arrive by broadcast), bf16 compute of the fp32 tiny qwen3: rank
    0 receives the fp32 masters of node 1's units for model.safetensors. The checkpoints hold both partitions and
    verify; checkpoint-2 resumes bit-exact on two nodes again and on one node (2 ranks of one torch.distributed.run:
    the same world, so the same operations in the same order); the one-node resume's checkpoint-4 model.safetensors
    has the two-node file's header and tensors, bit for bit."""
    straight = tmp_path / "nodes"
    _launch_two_nodes(straight, "--bf16")
    ckpt2, ckpt4 = straight / "run" / "checkpoint-2", straight / "run" / "checkpoint-4"
    for ckpt in (ckpt2, ckpt4):
        _assert_partitioned(ckpt, 2)
        verify_checkpoint(str(ckpt))
    ref, ref_info = _result(straight)
    ref1, _ = _result(straight, 1)
    for k in ref:
        assert torch.equal(ref[k], ref1[k]), f"{k} differs between the nodes"
    weights = load_file(ckpt4 / "model.safetensors")
    for k, v in weights.items():
        assert v.dtype == torch.float32 and torch.equal(v, ref[k]), k  # the fp32 masters, node 1's units included

    resumed = tmp_path / "nodes_resumed"
    _launch_two_nodes(resumed, "--bf16", "--resume", str(ckpt2))
    one_node = tmp_path / "one_node_resumed"
    _launch(one_node, 2, "--bf16", "--resume", str(ckpt2))
    for out in (resumed, one_node):
        got, info = _result(out)
        assert info["global_step"] == 4 and info["losses"] == ref_info["losses"][2:], (out.name, info)
        for k in ref:
            assert torch.equal(got[k], ref[k]), f"{k} differs after the resume ({out.name})"
    one_file = one_node / "run" / "checkpoint-4" / "model.safetensors"
    assert _header(one_file) == _header(ckpt4 / "model.safetensors")
    one_weights = load_file(one_file)
    for k in weights:
        assert torch.equal(one_weights[k], weights[k]), k


# --------------------------------------------------------------------------- faults
def _shm_of_runs() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("lazytrain-")} if os.path.isdir("/dev/shm") else set()


def _killed_run(tmp_path, where: str):
    """A 2-rank run (checkpoints every 2 steps) whose rank 1 SIGKILLs itself ``where`` at step 4 (mid-step) or in
    the save of step 4 (mid-save); returns (the launch, its run directory)."""
    shm_before = _shm_of_runs()
    run = tmp_path / "killed"
    proc = _launch(
        run, 2, check=False, environ=env(DP_TEST_KILL=where, DP_TEST_KILL_STEP="4", LAZYTRAIN_DP_TIMEOUT_S="60")
    )
    text = proc.stdout + proc.stderr
    print(text[-3000:])
    assert proc.returncode != 0
    assert "SIGKILL" in proc.stdout or "SIGKILL" in proc.stderr
    # torch.distributed.run's summary names the failed rank; the survivor names it when it got to report
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9", text), text[-3000:]
    run_dir = run / "run"
    assert not (run_dir / "checkpoint-4").exists()  # nothing published
    assert (run_dir / "checkpoint-2").is_dir()
    verify_checkpoint(str(run_dir / "checkpoint-2"))
    _assert_partitioned(run_dir / "checkpoint-2", 2)
    assert _shm_of_runs() <= shm_before
    return proc, run_dir


def _resume_after_fault(tmp_path, run_dir) -> None:
    """The previous checkpoint resumes (one process, the global batch, the same output_dir): it completes the run,
    and its own save removes the staging directory the killed save left."""
    out = tmp_path / "after"
    _launch(out, 1, "--per-device-batch", "4", "--run-dir", str(run_dir), "--resume", "last")
    _, info = _result(out)
    assert info["global_step"] == 4 and len(info["losses"]) == 2
    assert (run_dir / "checkpoint-4").is_dir()
    assert not list(run_dir.glob(".staging-*"))


@pytest.mark.slow  # 35-60 s under load: kept out of CI's default run
def test_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    """Rank 1 dies while writing its partition of checkpoint-4: the launch ends with an error naming rank 1, nothing
    is published (checkpoint-2 intact, verified, and it resumes), no shared-memory segment of the run is left."""
    proc, run_dir = _killed_run(tmp_path, "mid-save")
    text = proc.stdout + proc.stderr
    survivor = "rank 0: rank 1 died" in text
    print(f"the survivor named rank 1 itself: {survivor}")
    assert list(run_dir.glob(".staging-*"))  # the unfinished save, never renamed into place
    _resume_after_fault(tmp_path, run_dir)


@pytest.mark.slow
def test_rank_killed_mid_step_leaves_the_previous_checkpoint(tmp_path):
    """Rank 1 dies in the backward of a unit in step 4: the launch ends with an error naming rank 1, checkpoint-2 is
    intact and resumes, no shared-memory segment of the run is left."""
    proc, run_dir = _killed_run(tmp_path, "mid-step")
    print(f"the survivor named rank 1 itself: {'rank 0: rank 1 died' in proc.stdout + proc.stderr}")
    assert proc.returncode != 0
    assert not (run_dir / "checkpoint-4").exists()
    assert not list(run_dir.glob(".staging-*"))  # killed in the step: the save of step 4 never started
    _resume_after_fault(tmp_path, run_dir)


@pytest.mark.slow
def test_rank_that_stops_answering_ends_the_run_after_the_timeout(tmp_path):
    """Rank 1 stops (SIGSTOP, alive but silent) in the backward of a unit in step 4: rank 0's collective on a gloo
    group of the partitioned run ends after LAZYTRAIN_DP_TIMEOUT_S=20 s and its error names the timeout and the
    stopped rank; the launch ends (torch.distributed.run then kills the stopped rank), checkpoint-2 is intact."""
    run = tmp_path / "hung"
    environ = env(DP_TEST_KILL="hang-step", DP_TEST_KILL_STEP="4", LAZYTRAIN_DP_TIMEOUT_S="20")
    proc = _launch(run, 2, check=False, environ=environ)
    text = proc.stdout + proc.stderr
    print(text[-3000:])
    assert proc.returncode != 0
    assert "SIGSTOP" in text
    assert re.search(r"rank 0: .*rank 1 is stopped .*LAZYTRAIN_DP_TIMEOUT_S=20 s", text), text[-3000:]
    assert not (run / "run" / "checkpoint-4").exists()
    verify_checkpoint(str(run / "run" / "checkpoint-2"))
