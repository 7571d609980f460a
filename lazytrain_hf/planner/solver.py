"""The solver backend: which MILP solver runs (CBC or HiGHS), under what settings, and what it says it found.

Owns: `SOLVERS` and `resolve_solver` (``auto``: HiGHS when ``highspy`` is installed, else PuLP's bundled CBC),
and `run_solver`, which runs a built PuLP problem with the time limit, relative gap, warm start and thread count
given explicitly and quiet output, and reports status, gap, objective and bound read from the solver itself (CBC's log,
HiGHS' info), not only PuLP's summary. HiGHS runs in a child process that ends by the time limit, presolve
included (`highs_run.py`, Note: [HiGHS presolve ignores the time limit]), with the warm start handed over through
``Highs.setSolution``. Never raises on an infeasible or unsolved problem: it reports, and `solve`
decides (dedicated exception, incumbent with a warning, or the heuristic fallback). Knows the PuLP problem only,
not the formulation's variables, plans or cost models; imports pulp only inside its functions, never torch.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
import warnings
from typing import Any

SOLVERS = ("auto", "cbc", "highs")


def resolve_solver(solver: str) -> str:
    """The backend that ``solver`` (one of `SOLVERS`) names: ``"cbc"`` or ``"highs"``."""
    if solver not in SOLVERS:
        raise ValueError(f"solver={solver!r} is not supported; use one of {SOLVERS}.")
    if solver == "cbc":
        return "cbc"
    try:
        import highspy  # noqa: F401

        return "highs"
    except ImportError as e:
        if solver == "highs":
            raise ImportError("solver='highs' needs HiGHS: pip install highspy (or use solver='cbc').") from e
        return "cbc"


_CBC_RESULT = re.compile(r"^Result - (.+)$", re.M)
_CBC_OBJ = re.compile(r"^Objective value:\s+([-+0-9.eE]+)", re.M)
_CBC_BOUND = re.compile(r"^Lower bound:\s+([-+0-9.eE]+)", re.M)
_CBC_GAP = re.compile(r"^Gap:\s+([-+0-9.eE]+)", re.M)


def run_solver(
    prob: Any, solver: str, time_limit: float, gap: float, warm: bool, threads: int | None = None
) -> dict[str, Any]:
    """Run the solver on the PuLP problem ``prob``; return ``{"status", "has_solution", "gap", "objective", "bound",
    "seconds", "solver", "solver_result"}`` read from the solver itself (CBC's log / HiGHS' info), not only from
    PuLP's summary. ``status`` is one of ``optimal``, ``time_limit``, ``feasible``, ``infeasible``, ``no_solution``."""
    import pulp

    t0 = time.perf_counter()
    report: dict[str, Any] = {"solver": solver}
    if solver == "cbc":
        fd, log = tempfile.mkstemp(prefix="lazytrain_cbc_", suffix=".log")
        os.close(fd)
        try:
            with warnings.catch_warnings():
                # PuLP 3.3 deprecates the bundled-CBC class in favour of a separately installed CBC; the bundled
                # binary is what works offline, so keep using it.
                warnings.simplefilter("ignore", DeprecationWarning)
                cmd = pulp.PULP_CBC_CMD(
                    msg=False, timeLimit=time_limit, gapRel=gap, warmStart=warm, logPath=log, threads=threads
                )
            prob.solve(cmd)
            with open(log) as f:
                text = f.read()
        finally:
            if os.path.exists(log):
                os.unlink(log)
        m = _CBC_RESULT.search(text)
        result = m.group(1).strip() if m else pulp.LpStatus[prob.status]
        report["solver_result"] = result
        obj = _CBC_OBJ.search(text)
        bound = _CBC_BOUND.search(text)
        g = _CBC_GAP.search(text)
        report["objective"] = float(obj.group(1)) if obj else None
        report["bound"] = float(bound.group(1)) if bound else report["objective"]
        if g:
            report["gap"] = float(g.group(1))
        elif report["objective"] is not None and report["bound"] is not None:
            report["gap"] = abs(report["objective"] - report["bound"]) / max(abs(report["objective"]), 1e-12)
        else:
            report["gap"] = None
        infeasible = "infeasible" in result.lower() or prob.status == pulp.LpStatusInfeasible
        has_solution = (not infeasible) and prob.sol_status in (
            pulp.LpSolutionOptimal,
            pulp.LpSolutionIntegerFeasible,
        )
        if infeasible:
            status = "infeasible"
        elif result.lower().startswith("optimal"):
            status = "optimal"
        elif has_solution:
            status = "time_limit" if "time" in result.lower() else "feasible"
        else:
            status = "no_solution"
    else:
        # HiGHS in a child process bounded by the wall clock (See Note: [HiGHS presolve ignores the time limit] in
        # highs_run.py); the warm start goes in through Highs.setSolution (PuLP's HiGHS drops it: "warmStart" is
        # not a HiGHS option)
        from .highs_run import model_arrays, run_bounded

        variables = prob.variables()
        run = run_bounded(model_arrays(prob, warm), time_limit, gap, threads)
        if run["has_solution"]:
            for v, x in zip(variables, run["x"]):
                v.varValue = float(x)
        for k in ("objective", "bound", "gap", "solver_result", "presolve", "stopped"):
            report[k] = run[k]
        status, has_solution = run["status"], run["has_solution"]
    report["status"] = status
    report["has_solution"] = has_solution
    report["seconds"] = time.perf_counter() - t0
    return report
