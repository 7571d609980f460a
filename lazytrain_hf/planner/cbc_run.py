"""A CBC solve bounded by the wall clock: CBC's own limit first, then a stop signal, then a kill.

Owns `cbc_path` (the CBC binary this machine runs: PuLP's bundled one, else ``cbc`` on the PATH; an ImportError
naming the fix when neither runs) and `run_cbc` (write the PuLP problem as MPS and the warm start as a CBC solution
file, run CBC in its own process group under the deadline, read back its solution and what its log says it proved).
Imports pulp only inside its functions; knows neither the formulation nor plans.

Note: [CBC's own time limit is not the wall clock]
    PuLP hands CBC the limit as ``-sec`` and then waits for CBC's process with no limit at all, writing the model
    before and reading the solution after. CBC looks at ``-sec`` only between the phases of its search, so it
    overruns by however long the phase it is in takes: 0.5-0.7 s on the planner's models here (``-sec 1`` on the
    lookahead-8 model of a 94-layer Qwen3-235B ended after 1.67 s), and without bound when it stalls in one (held
    before it starts by a loaded machine or a wrapper, or in its preprocessing or root LP): a CBC held 30 s made a
    solve with a 2 s limit take 30.7 s. A stop signal is no bound either: CBC reads SIGINT only between nodes, and
    on the lookahead-2 model of that Qwen3-235B it ended 23.7 s after one sent during its root cuts. So the process
    keeps the deadline, as for HiGHS (Note: [HiGHS presolve ignores the time limit], highs_run.py): writing the
    model counts against the limit; CBC's ``-sec`` (wall-clock mode) is what is then left less `_MARGIN_SHARE` of
    it (at least `_MARGIN_S`, at most half), so CBC normally ends by itself and writes its incumbent; SIGINT goes
    to its process group `STOP_GRACE_S` before the deadline (best effort: CBC writes its incumbent if it reads the
    signal in time, and a CBC started from a background job may ignore it), and the group is killed at the
    deadline. A killed CBC has written no solution (a file it was writing may be partial and is never read): the
    report has none and says so, naming the incumbent's objective when CBC's log (buffered, so perhaps behind)
    has one, and the caller falls back on a plan it holds with that reason (`outcome.settle`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

STOP_GRACE_S = 0.5  # from SIGINT to CBC's process group to killing it
# CBC's own limit ends this share of the time left before the deadline, at least `_MARGIN_S` (at most half of it):
# from our start of CBC to its end, CBC ran 0.5-0.7 s past its ``-sec`` on an idle machine and ~1.5 s on a loaded one
# (2 cores, several solves at once)
_MARGIN_SHARE = 0.15
_MARGIN_S = 1.5
_MIN_RUN_S = 0.05  # less time than this left after writing the model: CBC is not started
_POLL_S = 0.02

_RESULT = re.compile(r"^Result - (.+)$", re.M)
_OBJECTIVE = re.compile(r"^Objective value:\s+([-+0-9.eE]+)", re.M)
_BEST_POSSIBLE = re.compile(r"best possible ([-+0-9.eE]+)")  # Cbc0010I / Cbc0005I: CBC's proven bound as it goes
_LOWER_BOUND = re.compile(r"^Lower bound:\s+([-+0-9.eE]+)", re.M)  # the summary's (3 decimals)
_INCUMBENT = re.compile(r"Integer solution of ([-+0-9.eE]+) found")  # Cbc0012I / Cbc0004I


def cbc_path(solver: str = "cbc") -> str:
    """The CBC binary to run: PuLP's bundled one when it is executable here, else ``cbc`` on the PATH.

    Raises:
        ImportError: neither runs (the message names ``solver``, the paths tried and the fix).
    """
    import pulp

    bundled = getattr(getattr(pulp, "PULP_CBC_CMD", None), "pulp_cbc_path", None)  # gone in PuLP 4
    if bundled and os.path.isfile(bundled) and os.access(bundled, os.X_OK):
        return os.path.realpath(bundled)
    on_path = shutil.which("cbc")
    if on_path:
        return on_path
    raise ImportError(
        f"solver={solver!r} needs CBC, and none runs here: PuLP's bundled binary ({bundled or 'absent in PuLP '}"
        f"{'' if bundled else pulp.__version__}) is not an executable file and no 'cbc' is on the PATH. Install "
        "one (pip install --force-reinstall pulp, or the coinor-cbc system package) or use solver='highs' (pip "
        "install highspy)."
    )


def run_cbc(prob: Any, time_limit: float, gap: float, warm: bool, threads: int | None = None) -> dict[str, Any]:
    """Solve the PuLP problem ``prob`` with CBC, ending by ``time_limit`` seconds from now by the wall clock (See
    Note: [CBC's own time limit is not the wall clock]); with ``warm`` the variables' values are CBC's start.

    With a solution, its values are set on ``prob``'s variables. Returns ``{"status", "has_solution",
    "objective", "bound", "gap", "solver_result", "stopped", "seconds"}``: ``status`` one of ``optimal``,
    ``time_limit``, ``feasible``, ``infeasible``, ``no_solution``; ``objective`` the incumbent's (``None`` without
    a solution), ``bound`` the best bound CBC proved (its log), ``gap`` their relative difference; ``stopped``: the
    deadline came before CBC ended by itself (signalled, or killed)."""
    import pulp

    if prob.sense != pulp.LpMinimize:
        raise ValueError("run_cbc reads CBC's bound of a minimisation; the planner's models minimise.")
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    path = cbc_path()
    tmp = tempfile.mkdtemp(prefix="lazytrain_cbc_")
    try:
        mps, sol, mst, log = (os.path.join(tmp, n) for n in ("model.mps", "model.sol", "start.mst", "cbc.log"))
        columns, column_names, row_names, _ = prob.writeMPS(mps, rename=1)
        files = pulp.COIN_CMD(path=path, msg=False)  # PuLP's writer and reader of CBC's solution files
        args = [path, mps]
        if warm:
            files.writesol(mst, prob, columns, column_names, row_names)
            args += ["-mips", mst]
        left = deadline - time.perf_counter()
        own = left - min(max(_MARGIN_S, _MARGIN_SHARE * left), left / 2)
        if own < _MIN_RUN_S:
            return _no_solution(f"no time left for CBC after writing the model ({time.perf_counter() - t0:.1f} s)", t0)
        args += ["-sec", f"{own:.3f}", "-timeMode", "elapsed", "-ratio", repr(float(gap))]
        if threads is not None:
            args += ["-threads", str(int(threads))]
        args += ["-solve", "-printingOptions", "all", "-solution", sol]
        with open(log, "w") as out:
            # its own session: the signals reach CBC and anything it runs under (a wrapper script), not us
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)  # fmt: skip
        signalled = killed = False
        try:
            while not _ended(proc):
                now = time.perf_counter()
                if now >= deadline - STOP_GRACE_S and not signalled:
                    _signal_group(proc, signal.SIGINT)
                    signalled = True
                if now >= deadline and not killed:
                    _signal_group(proc, signal.SIGKILL)
                    killed = True
                time.sleep(_POLL_S)
        finally:
            # whatever is left of its group (a wrapper's children; all of it when interrupted by KeyboardInterrupt)
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        with open(log, errors="replace") as f:
            text = f.read()
        took = time.perf_counter() - t0
        if not (signalled or killed) and proc.returncode != 0:
            raise RuntimeError(f"CBC ({path}) failed (exit {proc.returncode}): {text[-2000:].strip()}")
        if not os.path.exists(sol) and not (signalled or killed):
            m = _RESULT.search(text)
            return _no_solution(f"CBC wrote no solution ({m.group(1).strip() if m else 'no result in its log'})", t0)
        if killed or not os.path.exists(sol):
            incumbents = _INCUMBENT.findall(text)
            how = "killed" if killed else "stopped"
            lost = f"its incumbent of objective {incumbents[-1]} unwritten" if incumbents else "no incumbent yet"
            rep = _no_solution(f"CBC {how} at its wall-clock deadline ({took:.1f} s of {time_limit:g} s), {lost}", t0)
            rep["bound"] = _bound(text)
            rep["stopped"] = True
            return rep
        status, values, _, _, _, sol_status = files.readsol_MPS(sol, prob, columns, column_names, row_names)
        prob.assignVarsVals(values)
        prob.assignStatus(status, sol_status)
        return _report(prob, text, sol_status, signalled, t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _report(prob: Any, text: str, sol_status: int, signalled: bool, t0: float) -> dict[str, Any]:
    import pulp

    m = _RESULT.search(text)
    result = m.group(1).strip() if m else pulp.LpStatus[prob.status]
    low = result.lower()
    infeasible = "infeasible" in low or prob.status == pulp.LpStatusInfeasible
    has = not infeasible and sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if infeasible:
        status = "infeasible"
    elif has and low.startswith("optimal"):
        status = "optimal"
    elif has:
        status = "time_limit" if ("time" in low or signalled) else "feasible"
    else:
        status = "no_solution"
    objective = bound = gap = None
    if has:
        # the values CBC wrote, evaluated in the problem's own terms (its constant included)
        objective = float(pulp.value(prob.objective))
        bound = _bound(text)
        if bound is None and status == "optimal":
            bound = objective
        if bound is not None:
            bound = min(bound, objective)  # CBC prints its bound rounded; one past the incumbent is that rounding
            gap = abs(objective - bound) / max(abs(objective), 1e-12)
    else:
        bound = _bound(text)
    if signalled:
        result += " (stopped at the wall-clock deadline)"
    return {
        "status": status,
        "has_solution": has,
        "objective": objective,
        "bound": bound,
        "gap": gap,
        "solver_result": result,
        "stopped": signalled,
        "seconds": time.perf_counter() - t0,
    }


def _bound(text: str) -> float | None:
    """The last bound CBC's log states: its progress lines (8 digits) or else its summary (3 decimals)."""
    found = _BEST_POSSIBLE.findall(text)
    if found:
        return float(found[-1])
    m = _LOWER_BOUND.search(text)
    return float(m.group(1)) if m else None


def _no_solution(why: str, t0: float) -> dict[str, Any]:
    return {
        "status": "no_solution",
        "has_solution": False,
        "objective": None,
        "bound": None,
        "gap": None,
        "solver_result": why,
        "stopped": False,
        "seconds": time.perf_counter() - t0,
    }


def _ended(proc: subprocess.Popen) -> bool:
    """Whether CBC's process has ended, leaving it unreaped: its pid, the id of its process group, stays taken until
    ``proc.wait()``, so a signal to the group never reaches a process that took the id up since."""
    if not hasattr(os, "waitid"):
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):  # the group has ended (on macOS a group of zombies refuses)
        pass
