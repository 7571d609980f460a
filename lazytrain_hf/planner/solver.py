"""The solver backend: which MILP solver runs (CBC or HiGHS), under what settings, and what it says it found.

Owns: `SOLVERS` and `resolve_solver` (``auto``: HiGHS when ``highspy`` is installed, else PuLP's bundled CBC),
`run_solver`, which runs a built PuLP problem with the time limit, relative gap, warm start and thread count given
explicitly and quiet output, and reports status, gap, objective and bound read from the solver itself (CBC's log,
HiGHS' info), not only PuLP's summary, and `relaxation_bound` (the LP relaxation's optimum, a lower bound). Either
solver runs in a child process that ends by the time limit by the wall clock: CBC's binary (`cbc_run.py`, Note:
[CBC's own time limit is not the wall clock]), with the warm start as its start file, and a HiGHS worker, presolve
included (`highs_run.py`, Note: [HiGHS presolve ignores the time limit]), with the warm start handed over through
``Highs.setSolution``. Never raises on an infeasible or unsolved problem: it reports, and `solve` decides
(dedicated exception, incumbent with a warning, or the heuristic fallback). Knows the PuLP problem only, not the
formulation's variables, plans or cost models; imports pulp only inside its functions (here and in `cbc_run.py`),
never torch.
"""

from __future__ import annotations

import time
from typing import Any

from .cbc_run import cbc_path, run_cbc

SOLVERS = ("auto", "cbc", "highs")


def resolve_solver(solver: str) -> str:
    """The backend that ``solver`` (one of `SOLVERS`) names: ``"cbc"`` or ``"highs"``.

    Raises:
        ValueError: ``solver`` is not one of `SOLVERS`.
        ImportError: the solver it names does not run here (``highs``: highspy missing; ``cbc``, or ``auto``
            without highspy: no CBC binary runs).
    """
    if solver not in SOLVERS:
        raise ValueError(
            f"solver={solver!r} is not a supported MILP solver; use one of {', '.join(map(repr, SOLVERS))} "
            "('auto': HiGHS when highspy is installed, else CBC; `lazytrain plan --solver`, "
            "LazyTrainingArguments(planner_solver=...))."
        )
    if solver != "cbc":
        try:
            import highspy  # noqa: F401

            return "highs"
        except ImportError as e:
            if solver == "highs":
                raise ImportError("solver='highs' needs HiGHS: pip install highspy (or use solver='cbc').") from e
    cbc_path(solver)  # an ImportError naming the fix when no CBC runs
    return "cbc"


def run_solver(
    prob: Any, solver: str, time_limit: float, gap: float, warm: bool, threads: int | None = None
) -> dict[str, Any]:
    """Run the solver on the PuLP problem ``prob``, ending by ``time_limit`` seconds from now by the wall clock;
    return ``{"status", "has_solution", "gap", "objective", "bound", "seconds", "solver", "solver_result",
    "stopped"}`` read from the solver itself (CBC's log and solution / HiGHS' info), not only from PuLP's summary
    (HiGHS adds ``presolve``). ``status`` is one of ``optimal``, ``time_limit``, ``feasible``, ``infeasible``,
    ``no_solution``."""
    t0 = time.perf_counter()
    report: dict[str, Any] = {"solver": solver}
    if solver == "cbc":
        # CBC in its own process bounded by the wall clock (See Note: [CBC's own time limit is not the wall clock]
        # in cbc_run.py); its solution's values are set on prob's variables
        run = run_cbc(prob, time_limit, gap, warm, threads)
        for k in ("objective", "bound", "gap", "solver_result", "stopped"):
            report[k] = run[k]
        status, has_solution = run["status"], run["has_solution"]
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


def relaxation_bound(prob: Any, solver: str, time_limit: float) -> float | None:
    """A lower bound of the optimum of the PuLP (minimisation) problem ``prob``: its LP relaxation's optimum, with
    HiGHS (`highs_run.relaxation_bound`) within ``time_limit`` seconds; ``None`` when there is none (CBC, whose LP
    this module does not run, or an LP not solved in time). The batch search uses it to leave out batch sizes that
    cannot beat the plan it holds, and to prove a batch size infeasible without a MILP solve."""
    if solver != "highs":
        return None
    from .highs_run import model_arrays
    from .highs_run import relaxation_bound as lp_bound

    return lp_bound(model_arrays(prob, False), time_limit)
