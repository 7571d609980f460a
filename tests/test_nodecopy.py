"""The node's shared compute copy (lazytrain_hf/streaming/nodecopy.py): local ranks map one segment, the owner of a
unit writes and publishes it, the others wait and read it bit-exact; failures and timeouts name the rank; the
segment's name never outlives the run (Note: [The node copy is unlinked once every local rank mapped it]).

Real processes come from a forkserver that has imported torch once (each fork then starts in milliseconds); local
ranks that only need the protocol, not separate processes, are threads of the test process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import uuid

import pytest
import torch

from lazytrain_hf import pinned, streams
from lazytrain_hf.planner.layouts import align_up
from lazytrain_hf.planner.world import World
from lazytrain_hf.streaming import nodecopy
from lazytrain_hf.streaming.nodecopy import (
    SHM_DIR,
    TIMEOUT_ENV,
    NodeCopy,
    NodeCopyError,
    RankFailedError,
    WaitTimeoutError,
    dp_timeout_s,
    segment_name,
)

# units of the compute copy as the host store carves them: (elements, dtype)
UNITS = [(1000, torch.float32), (777, torch.bfloat16), (4096, torch.float32)]
DATA_NBYTES = 64 * 1024
RESULT_TIMEOUT_S = 60  # a child that does not report by then hung: the test fails instead of waiting forever


def _run_id() -> str:
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _leftovers(run_id: str) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if run_id in n]


def _unit_data(unit: int, version: int) -> torch.Tensor:
    n, dtype = UNITS[unit]
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * version + unit)).to(dtype)


def _carve_units(nc: NodeCopy) -> list[torch.Tensor]:
    return [nc.carve(n, dtype) for n, dtype in UNITS]


def _ctx():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "lazytrain_hf.streaming.nodecopy"])
    return ctx


def _child_setup() -> None:
    torch.set_num_threads(1)


def _start(ctx, target, nprocs: int, *args, ctx_of: dict | None = None) -> list:
    """Start ranks ``0 .. nprocs - 1``; ``ctx_of``: another multiprocessing context for some ranks."""
    ctx_of = ctx_of or {}
    procs = [ctx_of.get(r, ctx).Process(target=target, args=(r, *args), daemon=True) for r in range(nprocs)]
    for p in procs:
        p.start()
    return procs


def _results(q, n: int) -> dict:
    return dict(q.get(timeout=RESULT_TIMEOUT_S) for _ in range(n))


def _join(procs) -> list[int]:
    for p in procs:
        p.join(timeout=RESULT_TIMEOUT_S)
    return [p.exitcode for p in procs]


# ----------------------------------------------------------------------------------------- one copy, two processes
def _share_worker(rank: int, run_id: str, barrier, q) -> None:
    _child_setup()
    try:
        with NodeCopy(run_id, World(2, 1), rank, DATA_NBYTES, len(UNITS), barrier.wait, pin=True) as nc:
            views = _carve_units(nc)
            read = []
            for version in (1, 2):
                if rank == 1:  # the owner of every unit: write, then publish
                    for u, view in enumerate(views):
                        view.copy_(_unit_data(u, version))
                        nc.publish(u, version)
                else:
                    for u, view in enumerate(views):
                        nc.wait(u, version, owner_rank=1, timeout_s=RESULT_TIMEOUT_S)
                        read.append((u, version, bytes(view.view(torch.uint8).numpy().tobytes())))
                # the reader is done with this version before the owner rewrites it (in training: the gradient
                # reduction the owner's next update needs; Note: [A unit's version is published after its data])
                barrier.wait()
            q.put((rank, ("ok", read, nc.pinned)))
    except BaseException as e:
        barrier.abort()
        q.put((rank, ("error", repr(e), False)))


def test_two_processes_share_one_copy_bit_exact():
    run_id = _run_id()
    ctx = _ctx()
    barrier, q = ctx.Barrier(2, timeout=RESULT_TIMEOUT_S), ctx.Queue()
    procs = _start(ctx, _share_worker, 2, run_id, barrier, q)
    res = _results(q, 2)
    assert _join(procs) == [0, 0]
    assert res[1][0] == "ok" and res[0][0] == "ok", res
    assert res[0][2] and res[1][2], "the data region was not registered"
    read = res[0][1]
    assert [(u, v) for u, v, _ in read] == [(u, v) for v in (1, 2) for u in range(len(UNITS))]
    for u, v, raw in read:
        want = _unit_data(u, v).view(torch.uint8).numpy().tobytes()
        assert raw == want, f"unit {u} version {v}: the reader saw other bytes than the owner wrote"
    assert _leftovers(run_id) == []  # a normal exit


# ----------------------------------------------------------------------------------------- failures name the rank
def _failing_owner_worker(rank: int, run_id: str, how: str, victim: int, barrier, q) -> None:
    _child_setup()
    try:
        with NodeCopy(run_id, World(2, 1), rank, DATA_NBYTES, len(UNITS), barrier.wait, pin=True) as nc:
            if rank == victim:
                if how == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise ValueError("a bad batch")
            try:
                nc.wait(0, 1, owner_rank=victim, timeout_s=RESULT_TIMEOUT_S / 2)
                q.put((rank, ("returned", "")))
            except RankFailedError as e:
                q.put((rank, ("raised", f"{type(e).__name__}: {e}|{sorted(e.ranks)}")))
    except ValueError as e:
        q.put((rank, ("raised", repr(e))))
    except BaseException as e:
        q.put((rank, ("error", repr(e))))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("how", "victim"), [("sigkill", 1), ("sigkill", 0), ("exception", 1)])
def test_a_failed_owner_makes_the_waiter_raise_naming_it(how, victim):
    """The owner of unit 0 (local rank ``victim``; 0 created the segment) is killed or raises after the open. The
    killed local rank 1 is a direct child of this process ("spawn"), so it stays a zombie until it is joined, as
    under a launcher that polls its workers: the waiter must see a zombie as dead. (The forkserver reaps its
    children at once.)"""
    run_id = _run_id()
    waiter = 1 - victim
    ctx = _ctx()
    barrier, q = ctx.Barrier(2, timeout=RESULT_TIMEOUT_S), ctx.Queue()
    ctx_of = {1: mp.get_context("spawn")} if (how, victim) == ("sigkill", 1) else {}
    procs = _start(ctx, _failing_owner_worker, 2, run_id, how, victim, barrier, q, ctx_of=ctx_of)
    got = q.get(timeout=RESULT_TIMEOUT_S)
    while got[0] != waiter:
        got = q.get(timeout=RESULT_TIMEOUT_S)
    status, msg = got[1]
    assert status == "raised", got
    assert msg.startswith(f"RankFailedError: rank {waiter} waited for unit 0 to reach version 1"), msg
    assert msg.endswith(f"|[{victim}]"), msg
    exitcodes = _join(procs)
    if how == "sigkill":
        assert f"rank {victim} died (local rank {victim}, pid" in msg, msg
        assert exitcodes[victim] == -signal.SIGKILL and exitcodes[waiter] == 0
    else:
        assert f"rank {victim} failed (local rank {victim}, pid" in msg and "ValueError: a bad batch" in msg, msg
        assert exitcodes == [0, 0]
    assert _leftovers(run_id) == []  # SIGKILL of one process after the open (the creator too) / an exception


# ----------------------------------------------------------------------------------------- the name on every exit path
def _open_path_worker(rank: int, run_id: str, how: str, barrier, q) -> None:
    _child_setup()
    calls = []

    def node_barrier():
        calls.append(1)
        if rank == 0 and len(calls) == 2:  # local rank 0 created the name; the others mapped it
            if how == "creator_sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "creator_exception":
                raise KeyboardInterrupt
        barrier.wait()

    nbytes = DATA_NBYTES + (4096 if how == "attach_mismatch" and rank == 1 else 0)
    try:
        NodeCopy(run_id, World(2, 1), rank, nbytes, len(UNITS), node_barrier, pin=True).close()
        q.put((rank, "ok"))
    except BaseException as e:
        barrier.abort()  # as a torch.distributed barrier fails for the others when one rank is gone
        q.put((rank, f"{type(e).__name__}: {e}"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["creator_exception", "creator_sigkill", "attach_mismatch"])
def test_no_name_is_left_when_the_open_fails(how):
    run_id = _run_id()
    ctx = _ctx()
    barrier, q = ctx.Barrier(2, timeout=RESULT_TIMEOUT_S), ctx.Queue()
    procs = _start(ctx, _open_path_worker, 2, run_id, how, barrier, q)
    if how == "creator_sigkill":
        procs[0].join(timeout=RESULT_TIMEOUT_S)
        assert procs[0].exitcode == -signal.SIGKILL
        barrier.abort()  # the barrier's own failure when a rank is gone
        res = _results(q, 1)
        assert res[1].startswith("BrokenBarrierError"), res
    else:
        res = _results(q, 2)
        if how == "creator_exception":
            # local rank 1 is stopped at the second barrier, or finds the name already gone
            assert res[0] == "KeyboardInterrupt: ", res
            assert res[1].startswith("BrokenBarrierError") or "it failed or exited since" in res[1], res
        else:
            assert res[1].startswith("NodeCopyError: the shared-memory segment") and "every rank must pass" in res[1]
            assert res[0].startswith("BrokenBarrierError"), res
    _join(procs)
    assert _leftovers(run_id) == []


def _killed_creator_worker(rank: int, run_id: str, barrier) -> None:
    _child_setup()

    def node_barrier():
        os.kill(os.getpid(), signal.SIGKILL)  # created, nobody mapped it yet

    NodeCopy(run_id, World(2, 1), rank, DATA_NBYTES, len(UNITS), node_barrier, pin=False)


def test_a_name_left_by_a_killed_creator_is_removed_by_the_next_creation():
    run_id = _run_id()
    ctx = _ctx()
    (proc,) = _start(ctx, _killed_creator_worker, 1, run_id, None)
    assert _join([proc]) == [-signal.SIGKILL]
    # the one window the protocol cannot close: the creator killed while no other process maps the segment
    assert _leftovers(run_id) == [segment_name(run_id, 0)]
    nc = NodeCopy(run_id, World(1, 1), 0, 4096, 1, lambda: None, pin=False)
    assert _leftovers(run_id) == []
    nc.close()


# ----------------------------------------------------------------------------------------- local ranks as threads
def _open_threads(run_id: str, world: World, ranks: list[int], nbytes: int = DATA_NBYTES, units: int = len(UNITS)):
    barrier = threading.Barrier(len(ranks), timeout=RESULT_TIMEOUT_S)
    out, errors = {}, {}

    def run(r):
        try:
            out[r] = NodeCopy(run_id, world, r, nbytes, units, barrier.wait, pin=True)
        except BaseException as e:
            errors[r] = e
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, errors


def test_two_nodes_on_one_machine_stay_separate():
    run_id = _run_id()
    world = World(world_size=2, nodes=2)  # rank 0 on node 0, rank 1 on node 1, one local rank each
    n0 = NodeCopy(run_id, world, 0, DATA_NBYTES, len(UNITS), lambda: None, pin=True)
    n1 = NodeCopy(run_id, world, 1, DATA_NBYTES, len(UNITS), lambda: None, pin=True)
    other = NodeCopy(_run_id(), World(1, 1), 0, DATA_NBYTES, len(UNITS), lambda: None, pin=True)
    try:
        assert n0.name == segment_name(run_id, 0) != n1.name == segment_name(run_id, 1)
        views = [_carve_units(nc)[0] for nc in (n0, n1, other)]
        views[0].copy_(_unit_data(0, 1))
        n0.publish(0, 1)
        assert torch.equal(views[0], _unit_data(0, 1))
        assert not views[1].any() and not views[2].any(), "a write on node 0 landed in another node's copy"
        assert (n0.version(0), n1.version(0), other.version(0)) == (1, 0, 0)
        # node 1 learns rank 0's update only through its own publish (after the all-gather): a wait times out
        with pytest.raises(WaitTimeoutError) as e:
            n1.wait(0, 1, owner_rank=0, timeout_s=0.2)
        assert "rank 0 publishes it (on node 0; its update arrives by the all-gather)" in str(e.value)
        assert (e.value.rank, e.value.unit) == (0, 0)
    finally:
        for nc in (n0, n1, other):
            nc.close()
    assert _leftovers(run_id) == []


def test_timeout_names_rank_unit_timeout_and_env_var(monkeypatch):
    run_id = _run_id()
    ncs, errors = _open_threads(run_id, World(2, 1), [0, 1])
    assert not errors, errors
    try:
        monkeypatch.setenv(TIMEOUT_ENV, "0.25")
        with pytest.raises(WaitTimeoutError) as e:
            ncs[0].wait(2, 1, owner_rank=1)
        msg = str(e.value)
        assert msg.startswith("rank 0 waited 0.25 s for unit 2 to reach version 1 (it is at 0); rank 1 publishes it")
        assert f"raise {TIMEOUT_ENV} (seconds, now 0.25)" in msg
        # a published version returns at once, whatever the timeout; versions only grow
        ncs[1].publish(2, 1)
        ncs[0].wait(2, 1, owner_rank=1)
        with pytest.raises(ValueError, match=r"the unit is already at version 1; versions only grow"):
            ncs[1].publish(2, 0)
        # a rank that closed before publishing is named at once, not after the timeout
        ncs[1].close()
        with pytest.raises(RankFailedError, match=r"rank 1 closed its node copy \(pid \d+\) before publishing"):
            ncs[0].wait(1, 1, owner_rank=1, timeout_s=RESULT_TIMEOUT_S)
        ncs[0].check_peers()  # a closed rank is not a failed one
    finally:
        for nc in ncs.values():
            nc.close()
    assert _leftovers(run_id) == []


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "inf"])
def test_bad_timeout_env_is_refused(monkeypatch, raw):
    monkeypatch.setenv(TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=rf"{TIMEOUT_ENV}='{raw}' must be a positive number of seconds"):
        dp_timeout_s()


def test_timeout_env_default(monkeypatch):
    # a LazyTrainer trained earlier in this process made its ddp_timeout the process's default: start from none
    monkeypatch.setattr(nodecopy, "_default_timeout", (nodecopy.DEFAULT_TIMEOUT_S, TIMEOUT_ENV))
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert dp_timeout_s() == 600.0
    monkeypatch.setenv(TIMEOUT_ENV, "42.5")
    assert dp_timeout_s() == 42.5


def test_mark_failed_and_check_peers():
    run_id = _run_id()
    ncs, errors = _open_threads(run_id, World(3, 1), [0, 1, 2])
    assert not errors, errors
    try:
        ncs[0].check_peers()
        ncs[2].mark_failed(RuntimeError("out of memory"))
        assert list(ncs[0].dead_ranks()) == [2]
        with pytest.raises(RankFailedError, match=r"rank 2 failed \(local rank 2, pid \d+\): RuntimeError: out of"):
            ncs[1].check_peers()
        # a failure is not overwritten by the close that follows it
        ncs[2].close()
        assert list(ncs[0].dead_ranks()) == [2]
    finally:
        for nc in ncs.values():
            nc.close()


# ----------------------------------------------------------------------------------------- registration
@pytest.mark.usefixtures("async_engine")
def test_lane_copies_read_the_registered_region():
    run_id = _run_id()
    before = pinned.REGISTRY.registered_bytes
    nc = NodeCopy(run_id, World(1, 1), 0, DATA_NBYTES, len(UNITS), lambda: None, pin=True)
    lanes = streams.lanes_for(torch.device("cpu"), ["h2d"], "nodecopy-test")
    try:
        assert nc.pinned and pinned.REGISTRY.registered_bytes == before + DATA_NBYTES
        views = _carve_units(nc)
        for u, view in enumerate(views):
            view.copy_(_unit_data(u, 1))
        slot = torch.empty_like(views[1])
        lanes["h2d"].copy(slot, views[1]).synchronize()
        assert torch.equal(slot, _unit_data(1, 1))
        with pytest.raises(pinned.PageableCopyError, match="pageable memory"):
            lanes["h2d"].copy(slot, _unit_data(1, 1))
    finally:
        lanes.close()
        nc.close()
    # unregistered before the mapping can go (Note: [Unregister before free]); a view kept after close() is pageable
    assert pinned.REGISTRY.registered_bytes == before and not pinned.REGISTRY.is_pinned(views[0])
    assert torch.equal(views[0], _unit_data(0, 1))


@pytest.mark.usefixtures("async_engine")
def test_an_unpinned_copy_is_refused_by_the_lanes():
    nc = NodeCopy(_run_id(), World(1, 1), 0, DATA_NBYTES, 1, lambda: None, pin=False)
    lanes = streams.lanes_for(torch.device("cpu"), ["h2d"], "nodecopy-test")
    try:
        view = nc.carve(64, torch.float32)
        assert not nc.pinned
        with pytest.raises(pinned.PageableCopyError):
            lanes["h2d"].copy(torch.empty(64), view)
    finally:
        lanes.close()
        nc.close()


# ----------------------------------------------------------------------------------------- bad input
def test_bad_input_is_refused_with_the_fix():
    run_id = _run_id()
    with pytest.raises(ValueError, match=r"run_id='a/b' must be 1-128 characters"):
        NodeCopy("a/b", World(1, 1), 0, 4096, 1, lambda: None, pin=False)
    with pytest.raises(ValueError, match=r"rank=2 is outside the world of 2 ranks"):
        NodeCopy(run_id, World(2, 1), 2, 4096, 1, lambda: None, pin=False)
    with pytest.raises(NodeCopyError, match=r"cannot size the shared-memory segment .* --shm-size"):
        NodeCopy(run_id, World(1, 1), 0, 1 << 50, 1, lambda: None, pin=False)
    assert _leftovers(run_id) == []
    with NodeCopy(run_id, World(1, 1), 0, 4096, 2, lambda: None, pin=False) as nc:
        with pytest.raises(ValueError, match=r"cannot hold 8192 more bytes at offset 0"):
            nc.carve(2048, torch.float32)
        with pytest.raises(ValueError, match=r"unit=2 is outside the node copy's 2 units"):
            nc.publish(2, 1)
        with pytest.raises(ValueError, match=r"owner_rank=-1 is not a rank of the world of 1"):
            nc.wait(0, 1, owner_rank=-1)
        nc.wait(0, 0, owner_rank=-1)  # a unit with nothing to train stays at version 0
    with pytest.raises(NodeCopyError, match="is closed"):
        nc.version(0)


def test_a_name_in_use_by_a_live_run_is_refused():
    run_id = _run_id()
    refused = []

    def barrier():  # between the creation and the unlink the name is linked, its creator alive
        if not refused:
            with pytest.raises(NodeCopyError, match=r"belongs to process \d+, still alive: .* its own run_id") as e:
                NodeCopy(run_id, World(1, 1), 0, 4096, 1, lambda: None, pin=False)
            refused.append(e.value)

    NodeCopy(run_id, World(1, 1), 0, 4096, 1, barrier, pin=False).close()
    assert refused
    assert _leftovers(run_id) == []


# ----------------------------------------------------------------------------------------- two torchrun "nodes"
# The body of the test below, run by ``torch.distributed.run --nnodes 2 ... tests/test_nodecopy.py --worker OUT``.
def _torchrun_worker(out: str, run_id: str) -> None:
    import json

    import torch.distributed as dist

    from lazytrain_hf.planner.world import unit_owners

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), World(dist.get_world_size(), int(os.environ["GROUP_WORLD_SIZE"]))
    local = [
        dist.new_group(list(range(n * world.local_world_size, (n + 1) * world.local_world_size)))
        for n in range(world.nodes)
    ][world.node_of(rank)]
    owners = unit_owners([n for n, _ in UNITS] + [64], world.world_size)
    units = [*UNITS, (64, torch.float32)]
    nbytes = sum(align_up(n * d.itemsize) for n, d in units)
    with NodeCopy(run_id, world, rank, nbytes, len(units), lambda: dist.barrier(group=local), pin=True) as nc:
        views = [nc.carve(n, d) for n, d in units]

        def data(u: int) -> torch.Tensor:
            n, dtype = units[u]
            return torch.randn(n, generator=torch.Generator().manual_seed(1000 + u)).to(dtype)

        # each owner's update, then an all-gather brings every other node's units: the local rank with the owner's
        # local index writes and publishes them on this node
        mine = {u: data(u) for u, o in enumerate(owners) if o == rank}
        gathered = [None] * world.world_size
        dist.all_gather_object(gathered, mine)
        for part in gathered:
            for u, values in part.items():
                if world.local_rank(owners[u]) == world.local_rank(rank):
                    views[u].copy_(values)
                    nc.publish(u, 1)
        ok = True
        for u, o in enumerate(owners):
            nc.wait(u, 1, owner_rank=o, timeout_s=RESULT_TIMEOUT_S)
            ok &= torch.equal(views[u], data(u))
        dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"name": nc.name, "ok": bool(ok), "owners": owners, "node": world.node_of(rank)}, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_torchrun_nodes_on_one_machine(tmp_path):
    """Two ``torch.distributed.run --nnodes 2`` launches on localhost, 2 ranks each, gloo: each node has its own
    segment, remote units arrive by an all-gather and are published on the node, every rank reads every unit
    bit-exact, and nothing of the run is left in /dev/shm."""
    import json
    import socket
    import subprocess
    import sys

    run_id = _run_id()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]),
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                __file__,
                "--worker",
                str(tmp_path),
                run_id,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["ok"] for r in res), res
    assert [r["name"] for r in res] == [segment_name(run_id, 0)] * 2 + [segment_name(run_id, 1)] * 2
    assert sorted(set(res[0]["owners"])) == [0, 1, 2, 3]  # every rank owns a unit, two of them on the other node
    assert _leftovers(run_id) == []


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--worker"]:
        _torchrun_worker(sys.argv[2], sys.argv[3])
