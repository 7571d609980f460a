"""Spill files of a process that is interrupted: SIGINT runs the exit handlers (the engine's finalizer removes its
directory); SIGKILL cannot, so the next engine built on the same directory removes the dead process's leftovers.

Each test starts a child Python that spills a forward's activations to NVMe, reports its spill directory and then
blocks, still inside the step, until the parent signals it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lazytrain_hf.activations import ActivationEngine
from lazytrain_hf.planner.plan import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent(
    """
    import sys, time, torch
    import torch.nn as nn
    from lazytrain_hf.activations import ActivationEngine
    from lazytrain_hf.planner.plan import Plan

    plan = Plan.default(2)
    for lp in plan.layers:
        lp.policy = "offload_nvme"
    engine = ActivationEngine(plan, "cpu", nvme_dir=sys.argv[1])
    layers = [nn.Linear(64, 64) for _ in range(2)]
    x = torch.randn(8, 64, requires_grad=True)
    USE_STEP = sys.argv[2] == "step"

    def forward():
        h = x
        for i, layer in enumerate(layers):
            engine.begin_layer(i, layer, (h,), {})
            h = torch.tanh(layer(h))
            engine.end_layer(i)
        engine.synchronize()
        print(engine.spill_dir, len(engine.spill_files()), flush=True)
        time.sleep(120)  # interrupted here, inside the step
        return h

    if USE_STEP:
        with engine.step():
            forward()
    else:
        out = forward()  # no step(): only the exit handler can clean up
    """
)


def start_child(nvme_dir: str, mode: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, nvme_dir, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline().split()
    if len(line) != 2:
        proc.kill()
        raise AssertionError(f"child did not start: {proc.stderr.read()[-2000:]}")
    spill_dir, nfiles = line[0], int(line[1])
    assert nfiles == 2 and os.path.isdir(spill_dir) and len(os.listdir(spill_dir)) == 2
    return proc, spill_dir


def wait_exit(proc: subprocess.Popen, timeout: float = 60) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("mode", ["step", "bare"])
def test_sigint_removes_spill_files(tmp_path, mode):
    proc, spill_dir = start_child(str(tmp_path), mode)
    proc.send_signal(signal.SIGINT)
    rc = wait_exit(proc)
    assert rc != 0  # KeyboardInterrupt
    assert not os.path.exists(spill_dir), os.listdir(spill_dir)
    assert os.listdir(tmp_path) == []


def test_sigkill_leftovers_removed_by_next_engine(tmp_path):
    proc, spill_dir = start_child(str(tmp_path), "step")
    proc.send_signal(signal.SIGKILL)
    assert wait_exit(proc) == -signal.SIGKILL
    deadline = time.time() + 10
    while time.time() < deadline and os.path.exists(f"/proc/{proc.pid}"):
        time.sleep(0.05)  # reaped: the pid is gone
    assert os.path.isdir(spill_dir) and len(os.listdir(spill_dir)) == 2  # nothing could clean up
    ActivationEngine(Plan.default(1), "cpu", nvme_dir=str(tmp_path)).close()
    assert not os.path.exists(spill_dir)
    assert os.listdir(tmp_path) == []
