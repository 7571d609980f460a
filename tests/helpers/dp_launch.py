"""Launching the data-parallel test bodies (tests/helpers/ddp_train.py, dp_checkpoint.py): on one node with
``torch.distributed.run --standalone`` (one plain process for 1 rank), or as two ``torch.distributed.run --nnodes 2``
launches on localhost (two nodes of one rank each: each node creates its own shared-memory compute copy, named by
the node index, and units owned on the other node arrive by the local-rank group's broadcast). gloo on CPU, one
thread per rank."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = os.path.join(TESTS, "helpers")


def env(**extra: str) -> dict:
    """The environment of a launch: the tests and the repository importable, 1 thread per rank, no inherited RANK."""
    out = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.path.dirname(TESTS)]), OMP_NUM_THREADS="1")
    out.pop("RANK", None)
    out.update(extra)
    return out


def run_ranks(
    script: str, out, nproc: int, *args: str, environ: dict | None = None, timeout: int = 900
) -> subprocess.CompletedProcess:
    """``script --out <out> args`` on ``nproc`` ranks of one node (a plain process for 1); output captured."""
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd = (head if nproc > 1 else [sys.executable]) + [script, "--out", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=environ or env(), timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_nodes(script: str, *args: str, environ: dict | None = None, timeout: int = 900) -> list[tuple[int, str]]:
    """``script args`` as two ``torch.distributed.run --nnodes 2 --nproc-per-node 1`` launches on localhost (node
    ranks 0 and 1, one rendezvous port); returns each launch's (exit status, output)."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), script, *args],
            env=environ or env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, log) for p, log in zip(procs, logs)]
