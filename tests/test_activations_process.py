"""Spill files of a process that is interrupted: SIGINT runs the exit handlers (the engine's finalizer removes its
directory); SIGKILL cannot, so the next engine built on the same directory removes the dead process's leftovers.

Each test starts a child Python that spills activations to NVMe and reports its spill directory on stdout once the
files exist (the readiness signal: the parent never sleeps for the child); the parent then signals it. In ``step``
and ``bare`` mode the child blocks after one forward, inside the step or outside any; in ``loop`` mode it keeps
training (forward, NVMe writes and reads in flight on the worker threads, backward) so the signal lands wherever the
step happens to be.

Note: [A child started from a background job ignores SIGINT]
    A shell without job control (``sh -c 'pytest ... &'``, CI runners, ``nohup``) starts background commands with
    SIGINT set to SIG_IGN; the disposition is inherited through fork and exec, and Python leaves an ignored SIGINT
    ignored (it installs `signal.default_int_handler` only over SIG_DFL). Such a child sleeps through the parent's
    SIGINT, which is how this test once failed on a machine where the suite ran in the background ("did not exit
    within 60 s"; run alone in a terminal it passed). A user's Ctrl-C reaches a foreground process, whose SIGINT is
    the default: the child installs `signal.default_int_handler` itself, as such a process has, and
    `test_child_handles_sigint_when_started_ignored` runs the whole check from a parent that ignores SIGINT.
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
    import signal, sys, time, torch
    import torch.nn as nn
    from lazytrain_hf.activations import ActivationEngine
    from lazytrain_hf.planner.plan import Plan

    # Note: [A child started from a background job ignores SIGINT] (tests/test_activations_process.py)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    MODE = sys.argv[2]
    plan = Plan.default(2)
    for lp in plan.layers:
        lp.policy = "offload_nvme"
    engine = ActivationEngine(plan, "cpu", nvme_dir=sys.argv[1])
    layers = [nn.Linear(64, 64) for _ in range(2)]
    x = torch.randn(8, 64, requires_grad=True)

    def forward():
        h = x
        for i, layer in enumerate(layers):
            engine.begin_layer(i, layer, (h,), {})
            h = torch.tanh(layer(h))
            engine.end_layer(i)
        return h

    def ready():
        print(engine.spill_dir, len(engine.spill_files()), flush=True)

    if MODE == "step":
        with engine.step():
            out = forward()  # the graph holds the spilled entries
            engine.synchronize()
            ready()
            time.sleep(600)  # interrupted here, inside the step
    elif MODE == "bare":
        out = forward()  # no step(): only the exit handler can clean up
        engine.synchronize()
        ready()
        time.sleep(600)
    else:  # "loop": steps back to back; the signal lands anywhere in a step
        first = True
        while True:
            with engine.step():
                out = forward()
                if first:
                    engine.synchronize()
                    ready()
                    first = False
                out.sum().backward()
    """
)


def start_child(tmp_path, mode: str, ignore_sigint: bool = False) -> tuple[subprocess.Popen, str]:
    """Start the child (spill root ``tmp_path/nvme``, its stderr in ``tmp_path/child.stderr``) and wait for its
    readiness line; ``ignore_sigint``: start it with SIGINT ignored, as a background job of a shell without job
    control is."""
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-c", CHILD, str(nvme_dir), mode]
    if ignore_sigint:
        # SIG_IGN survives exec: the child starts as under `sh -c 'cmd &'`
        code = (
            "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])"
        )
        argv = [sys.executable, "-c", code, *argv]
    with open(tmp_path / "child.stderr", "w") as err:  # a file: a chatty child cannot fill a pipe and block
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    line = proc.stdout.readline().split()  # the readiness signal: blocks however loaded the machine is
    if len(line) != 2:
        proc.kill()
        proc.wait()
        raise AssertionError(f"child did not start: {(tmp_path / 'child.stderr').read_text()[-2000:]}")
    spill_dir, nfiles = line[0], int(line[1])
    try:
        assert nfiles == 2 and os.path.isdir(spill_dir)
        if mode != "loop":  # a looping child goes on creating and removing its files
            assert len(os.listdir(spill_dir)) == 2
    except AssertionError:
        proc.kill()  # a child left running would loop for ever
        proc.wait()
        raise
    return proc, spill_dir


def wait_exit(proc: subprocess.Popen, timeout: float = 120) -> int:
    """The child's exit code; a hang guard only (exit takes seconds, interpreter teardown included, under load)."""
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _check_sigint(tmp_path, mode: str, ignore_sigint: bool = False) -> None:
    proc, spill_dir = start_child(tmp_path, mode, ignore_sigint)
    proc.send_signal(signal.SIGINT)
    rc = wait_exit(proc)
    stderr = (tmp_path / "child.stderr").read_text()
    assert rc == -signal.SIGINT, (rc, stderr[-2000:])  # KeyboardInterrupt unhandled: Python re-raises SIGINT
    assert "KeyboardInterrupt" in stderr, stderr[-2000:]
    assert not os.path.exists(spill_dir), os.listdir(spill_dir)
    assert os.listdir(tmp_path / "nvme") == []


@pytest.mark.parametrize("mode", ["step", "bare", "loop"])
def test_sigint_removes_spill_files(tmp_path, mode):
    _check_sigint(tmp_path, mode)


def test_child_handles_sigint_when_started_ignored(tmp_path):
    """Note: [A child started from a background job ignores SIGINT]: the check holds when the test itself runs as
    a background job (without the child's `default_int_handler` this child sleeps through the signal)."""
    _check_sigint(tmp_path, "step", ignore_sigint=True)


# Ctrl-C landing while `Thread.start()` waits for a new spill I/O thread to run (the main thread blocks there when
# a pool starts a worker): injected, so that the race seen under load happens on every run
INTERRUPT_THREAD_START = textwrap.dedent(
    """
    import threading
    _start = threading.Thread.start

    def start(self):
        _start(self)
        if self.name.startswith("lazytrain-spill-r") and not getattr(start, "done", False):
            start.done = True
            raise KeyboardInterrupt

    threading.Thread.start = start
    """
)


def test_ctrl_c_while_an_io_thread_starts_still_exits(tmp_path):
    """Note: [Spill I/O threads never block exit] in activations/nvme.py: a KeyboardInterrupt raised while a spill
    reader thread starts must not leave a thread that the interpreter's exit waits for (it did: the child never
    exited, and its spill files stayed)."""
    (tmp_path / "nvme").mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-c", INTERRUPT_THREAD_START + CHILD, str(tmp_path / "nvme"), "loop"]
    with open(tmp_path / "child.stderr", "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
    rc = wait_exit(proc)
    stderr = (tmp_path / "child.stderr").read_text()
    assert rc == -signal.SIGINT and "KeyboardInterrupt" in stderr, (rc, stderr[-2000:])
    assert os.listdir(tmp_path / "nvme") == []


def test_sigkill_leftovers_removed_by_next_engine(tmp_path):
    proc, spill_dir = start_child(tmp_path, "step")
    proc.send_signal(signal.SIGKILL)
    assert wait_exit(proc) == -signal.SIGKILL
    deadline = time.time() + 60
    while time.time() < deadline and os.path.exists(f"/proc/{proc.pid}"):
        time.sleep(0.05)  # reaped: the pid is gone
    assert os.path.isdir(spill_dir) and len(os.listdir(spill_dir)) == 2  # nothing could clean up
    ActivationEngine(Plan.default(1), "cpu", nvme_dir=str(tmp_path / "nvme")).close()
    assert not os.path.exists(spill_dir)
    assert os.listdir(tmp_path / "nvme") == []


def test_graph_freed_while_spill_write_in_flight(tmp_path, monkeypatch):
    """A graph freed before its spill writes ran (an interrupted or abandoned forward): the entries are released
    while the writer still holds their file. The file must stay open until the write finished (closing it made the
    write fail with EBADF, or land in whatever file reused the descriptor), and the step then ends cleanly."""
    import threading

    import torch
    import torch.nn as nn

    from lazytrain_hf.activations.nvme import SpillDir

    gate = threading.Event()
    original = SpillDir.write

    def gated_write(self, f, region, nbytes, offset):
        gate.wait(60)  # every write waits until the graph is gone
        return original(self, f, region, nbytes, offset)

    monkeypatch.setattr(SpillDir, "write", gated_write)
    plan = Plan.default(2)
    for lp in plan.layers:
        lp.policy = "offload_nvme"
    engine = ActivationEngine(plan, "cpu", nvme_dir=str(tmp_path))
    try:
        torch.manual_seed(0)
        layers = [nn.Linear(64, 64) for _ in range(2)]
        with engine.step():
            h = torch.randn(8, 64, requires_grad=True)
            for i, layer in enumerate(layers):
                engine.begin_layer(i, layer, (h,), {})
                h = torch.tanh(layer(h))
                engine.end_layer(i)
            assert len(engine.spill_files()) == 2
            del h  # the graph and its saved tensors go before any write ran
            gate.set()
            engine.synchronize()  # raises ActivationSpillError when a write found its file closed
        assert engine.spill_files() == []
    finally:
        gate.set()
        engine.close()
    assert os.listdir(tmp_path) == []
