"""The HiGHS command with a warm start that reaches the solver.

Owns `highs_command`: PuLP's HiGHS backend (highspy API) with the start handed to HiGHS itself through
`highspy.Highs.setSolution`. PuLP 3.3 passes ``warmStart=True`` on as a HiGHS option, which HiGHS rejects without a
word, so before this the start never arrived. Called by `solver._solve`; knows the PuLP problem only (the variables'
initial values), nothing of the formulation, plans or cost models. Imports pulp, numpy and highspy only inside it.
"""

from __future__ import annotations

from typing import Any


def highs_command(warm: bool = False, **options: Any) -> Any:
    """A ``pulp.HiGHS`` (highspy API) command that hands the variables' initial values (``setInitialValue``) to
    HiGHS with ``Highs.setSolution`` before it runs, when ``warm``.

    ``options`` are `pulp.HiGHS`'s (``msg``, ``timeLimit``, ``gapRel``, ``threads``, HiGHS options). After the
    solve, ``command.warm_start`` says what became of the start: ``"none"`` (not asked for or no values set),
    ``"accepted"`` (HiGHS took it: ``setSolution`` returned kOk) or ``"rejected: <status>"``.

    Raises:
        ImportError: highspy is not installed (``pip install highspy``).
    """
    import pulp

    try:
        import highspy
    except ImportError as e:
        raise ImportError("the HiGHS warm start needs highspy: pip install highspy (or use solver='cbc').") from e
    options.pop("warmStart", None)  # never passed on: HiGHS has no such option

    class _HiGHSWithStart(pulp.HiGHS):
        warm_start = "none"

        def callSolver(self, lp: Any) -> None:
            if warm:
                # `buildSolverModel` numbered the columns in `lp.variables()` order (var.index); a partial start
                # (the binaries only) is completed by HiGHS, which solves the LP of the rest
                start = [(v.index, float(v.varValue)) for v in lp.variables() if v.varValue is not None]
                if start:
                    import numpy as np

                    idx = np.array([i for i, _ in start], dtype=np.int32)
                    val = np.array([x for _, x in start], dtype=np.float64)
                    status = lp.solverModel.setSolution(len(start), idx, val)
                    ok = status == highspy.HighsStatus.kOk
                    self.warm_start = "accepted" if ok else f"rejected: {status}"
            lp.solverModel.run()

    return _HiGHSWithStart(**options)
