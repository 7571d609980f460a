"""A HiGHS solve in a child process, bounded by the wall clock: the one way to stop a presolve that runs on.

Owns `model_arrays` (a PuLP problem as HiGHS's column / row arrays, plus the warm start PuLP holds as initial
values), `relaxation_bound` (the LP relaxation's optimum, solved in this process), `run_bounded` (the parent: start
the worker, watch its presolve and its deadline, stop it, read back its result or its last incumbent) and the
worker itself (this file run as a script: build the model with ``Highs.passModel``, hand the warm start over with
``Highs.setSolution``, solve, write every improving solution to disk as it is found). Imports highspy only in the
worker and `relaxation_bound`, and numpy only inside functions; knows neither PuLP's formulation nor plans.

Note: [HiGHS presolve ignores the time limit]
    HiGHS checks ``time_limit`` in simplex, IPM and branch-and-bound, but its MIP presolve can run far past it: the
    lookahead-2 model of a 94-layer Qwen3-235B-shaped config at seq 8192, batch 4 on h200 (1603 rows, 2060 columns)
    was still in presolve 125 s into a solve with a 22 s limit, while with presolve off it solves in ~10 s. No
    callback fires inside presolve, so a solve in this process can be neither interrupted nor timed out. The
    worker runs in its own process instead: presolve gets `PRESOLVE_SHARE` of the limit (it takes well under a
    second on every model that does not hang); a worker still presolving then is killed and the solve restarted
    without presolve for the rest of the time; a worker still running at the deadline is asked to stop (the
    interrupt callback reads a stop file) and killed `STOP_GRACE_S` later, keeping the last improving solution it
    wrote. A fresh process also gets a fresh HiGHS thread scheduler, so ``threads`` may differ between solves
    (in one process HiGHS refuses a thread count other than its scheduler's first one and returns no solution).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

PRESOLVE_SHARE = 0.25  # of the time limit, for HiGHS's presolve (at least `PRESOLVE_MIN_S`)
PRESOLVE_MIN_S = 2.0
STOP_GRACE_S = 0.25  # from asking the worker to stop to killing it
_MARGIN_S = 0.4  # HiGHS's own time limit ends this much before the deadline (its write-back of the result)
_POLL_S = 0.02


def model_arrays(prob: Any, warm: bool) -> dict[str, Any]:
    """The PuLP problem ``prob`` as HiGHS arrays (CSR rows), its variables in `prob.variables()` order, and with
    ``warm`` the initial values set on its variables (``start``: indices and values; continuous variables left out
    are completed by HiGHS)."""
    import numpy as np
    import pulp

    variables = prob.variables()
    index = {v.name: j for j, v in enumerate(variables)}
    n = len(variables)
    inf = float("inf")
    sense = 1 if prob.sense == pulp.LpMinimize else -1
    cost = np.zeros(n)
    for v, c in prob.objective.items():
        cost[index[v.name]] = sense * c
    lower = np.array([-inf if v.lowBound is None else v.lowBound for v in variables], dtype=float)
    upper = np.array([inf if v.upBound is None else v.upBound for v in variables], dtype=float)
    integer = np.array([1 if v.cat == pulp.LpInteger else 0 for v in variables], dtype=np.int32)
    starts, idx, val, rlo, rup = [0], [], [], [], []
    constraints = prob.constraints
    for c in constraints() if callable(constraints) else constraints.values():  # PuLP 3.3+ : a list
        for v, a in c.items():
            if a != 0:
                idx.append(index[v.name])
                val.append(a)
        starts.append(len(idx))
        lb, ub = c.getLb(), c.getUb()
        rlo.append(-inf if lb is None else lb)
        rup.append(inf if ub is None else ub)
    out = {
        "cost": cost,
        "offset": np.array([sense * (prob.objective.constant or 0.0)]),
        "col_lower": lower,
        "col_upper": upper,
        "integrality": integer,
        "row_lower": np.array(rlo, dtype=float),
        "row_upper": np.array(rup, dtype=float),
        "a_start": np.array(starts, dtype=np.int32),
        "a_index": np.array(idx, dtype=np.int32),
        "a_value": np.array(val, dtype=float),
        "sense": np.array([sense]),
    }
    if warm:
        known = [(j, v.varValue) for j, v in enumerate(variables) if v.varValue is not None]
        out["start_index"] = np.array([j for j, _ in known], dtype=np.int32)
        out["start_value"] = np.array([x for _, x in known], dtype=float)
    return out


def run_bounded(
    arrays: dict[str, Any], time_limit: float, gap: float, threads: int | None = None, presolve: bool = True
) -> dict[str, Any]:
    """Solve ``arrays`` (`model_arrays`) with HiGHS in a child process that ends by ``time_limit`` seconds from now
    (See Note: [HiGHS presolve ignores the time limit]).

    Returns ``{"status", "has_solution", "x", "objective", "bound", "gap", "solver_result", "presolve", "stopped",
    "seconds"}``: ``status`` one of ``optimal``, ``time_limit``, ``feasible``, ``infeasible``, ``no_solution``;
    ``x`` the column values (numpy) when ``has_solution``; ``objective`` / ``bound`` in the problem's sense;
    ``presolve`` what happened to presolve (``on``, ``off``, or ``off after <s> s of presolve``); ``stopped``:
    the worker was stopped at the deadline and its last improving solution taken (``gap`` is then measured
    against the dual bound known when that solution was found, an upper bound of the true gap)."""
    import numpy as np

    t0 = time.perf_counter()
    deadline = t0 + time_limit
    tmp = tempfile.mkdtemp(prefix="lazytrain_highs_")
    try:
        np.savez(os.path.join(tmp, "model.npz"), **arrays)
        presolve_note = "on" if presolve else "off"
        while True:
            left = deadline - time.perf_counter()
            # the worker sets HiGHS's limit from the wall-clock deadline once it has started (process start and
            # imports take ~0.3 s), so HiGHS normally ends by itself before the stop file and the kill
            opts = {"deadline": time.time() + left - _MARGIN_S, "mip_rel_gap": gap, "threads": threads}
            opts["presolve"] = "on" if presolve else "off"
            proc = _launch(tmp, opts)
            started = time.perf_counter()
            budget = max(PRESOLVE_MIN_S, PRESOLVE_SHARE * time_limit)
            restart = stopped = False
            while proc.poll() is None:
                now = time.perf_counter()
                if presolve and now - started > budget and not os.path.exists(os.path.join(tmp, "presolved")):
                    restart = now < deadline - 1.0  # still time left to solve without presolve
                    if restart:
                        _kill(proc)
                        presolve_note = f"off after {now - started:.1f} s of presolve"
                        break
                if now >= deadline - STOP_GRACE_S and not stopped:  # HiGHS missed its own limit
                    open(os.path.join(tmp, "stop"), "w").close()
                    stopped = True
                if now >= deadline:
                    _kill(proc)
                    break
                time.sleep(_POLL_S)
            if restart:
                presolve = False
                continue
            break
        report = _read_result(tmp, proc)
        report["presolve"] = presolve_note
        report["seconds"] = time.perf_counter() - t0
        return report
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _launch(tmp: str, opts: dict[str, Any]) -> subprocess.Popen:
    with open(os.path.join(tmp, "options.json"), "w") as f:
        json.dump(opts, f)
    for name in ("presolved", "stop", "incumbent.npz", "result.npz", "bound.txt"):
        if os.path.exists(os.path.join(tmp, name)):
            os.unlink(os.path.join(tmp, name))
    # -I: only the interpreter's site-packages (numpy, highspy), never the caller's working directory
    return subprocess.Popen(
        [sys.executable, "-I", os.path.abspath(__file__), tmp],
        stdout=subprocess.DEVNULL,  # HiGHS prints its banner even with output_flag off
        stderr=subprocess.PIPE,
    )


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    if proc.stderr:
        proc.stderr.close()


def _read_result(tmp: str, proc: subprocess.Popen) -> dict[str, Any]:
    import numpy as np

    res_path, inc_path = os.path.join(tmp, "result.npz"), os.path.join(tmp, "incumbent.npz")
    err = ""
    if proc.stderr and not proc.stderr.closed:
        err = proc.stderr.read().decode(errors="replace").strip()
        proc.stderr.close()
    if proc.returncode == 0 and os.path.exists(res_path):
        r = np.load(res_path)
        meta = json.loads(str(r["meta"]))
        meta["x"] = r["x"] if meta["has_solution"] else None
        meta["stopped"] = False
        return meta
    if proc.returncode not in (0, -9) and err:
        raise RuntimeError(f"the HiGHS worker failed (exit {proc.returncode}): {err[-2000:]}")
    # stopped at the deadline: the last improving solution the worker wrote, if any
    if os.path.exists(inc_path):
        r = np.load(inc_path)
        obj, bound = float(r["objective"]), float(r["bound"])
        bound_path = os.path.join(tmp, "bound.txt")
        if os.path.exists(bound_path):  # the last bound the worker proved (bounds only tighten)
            with open(bound_path) as f:
                later = float(f.read())
            bound = max(bound, later) if r["sense"] > 0 else min(bound, later)
        return {
            "status": "time_limit",
            "has_solution": True,
            "x": r["x"],
            "objective": obj,
            "bound": bound,
            "gap": abs(obj - bound) / max(abs(obj), 1e-12),
            "solver_result": "Time limit reached (worker stopped at the deadline)",
            "stopped": True,
        }
    return {
        "status": "no_solution",
        "has_solution": False,
        "x": None,
        "objective": None,
        "bound": None,
        "gap": None,
        "solver_result": "Time limit reached (worker stopped at the deadline, no solution yet)",
        "stopped": True,
    }


def relaxation_bound(arrays: dict[str, Any], time_limit: float) -> float | None:
    """The optimum of the LP relaxation of ``arrays`` (`model_arrays`; every column continuous), in the problem's
    sense: a lower bound of the MILP's optimum (every planner model minimises). ``None`` when HiGHS does not prove
    the LP optimal within ``time_limit`` seconds.

    Solved in this process and without presolve (See Note: [HiGHS presolve ignores the time limit]: the presolve
    that runs on is the MIP presolve; simplex checks the time limit): an LP of the planner's size (~2000 columns)
    takes 0.1-0.3 s, less than starting a worker."""
    import highspy
    import numpy as np

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("presolve", "off")
    h.setOptionValue("time_limit", max(0.01, float(time_limit)))
    ncol = len(arrays["cost"])
    h.passModel(
        ncol, len(arrays["row_lower"]), len(arrays["a_value"]), 2, 1, float(arrays["offset"][0]),
        arrays["cost"], arrays["col_lower"], arrays["col_upper"], arrays["row_lower"], arrays["row_upper"],
        arrays["a_start"], arrays["a_index"], arrays["a_value"], np.zeros(ncol, dtype=np.int32),
    )  # fmt: skip
    h.run()
    if h.modelStatusToString(h.getModelStatus()).lower() != "optimal":
        return None
    return float(arrays["sense"][0]) * float(h.getInfo().objective_function_value)


# ---------------------------------------------------------------------------------------------- the worker
def _worker(tmp: str) -> None:
    import highspy
    import numpy as np

    m = np.load(os.path.join(tmp, "model.npz"))
    with open(os.path.join(tmp, "options.json")) as f:
        opts = json.load(f)
    sense = int(m["sense"][0])
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", max(0.01, float(opts["deadline"]) - time.time()))
    h.setOptionValue("mip_rel_gap", float(opts["mip_rel_gap"]))
    h.setOptionValue("presolve", opts["presolve"])
    if opts.get("threads") is not None:
        h.setOptionValue("threads", int(opts["threads"]))
    ncol, nrow = len(m["cost"]), len(m["row_lower"])
    h.passModel(
        ncol, nrow, len(m["a_value"]), 2, 1, float(m["offset"][0]),  # 2: row-wise (CSR); 1: minimise
        m["cost"], m["col_lower"], m["col_upper"], m["row_lower"], m["row_upper"],
        m["a_start"], m["a_index"], m["a_value"], m["integrality"],
    )  # fmt: skip
    if "start_index" in m.files and len(m["start_index"]):
        h.setSolution(len(m["start_index"]), m["start_index"], m["start_value"])
    stop_file, presolved = os.path.join(tmp, "stop"), os.path.join(tmp, "presolved")
    bound_file = os.path.join(tmp, "bound.txt")
    seen = {"presolved": False, "checked": 0.0}

    def on_event(kind, message, out, data_in, user_data) -> None:
        if kind == highspy.cb.HighsCallbackType.kCallbackMipImprovingSolution:
            tmp_path = os.path.join(tmp, "incumbent.tmp.npz")
            np.savez(
                tmp_path,
                x=np.array(out.mip_solution),
                objective=sense * out.objective_function_value,
                sense=sense,
                bound=sense * out.mip_dual_bound,
            )
            os.replace(tmp_path, os.path.join(tmp, "incumbent.npz"))
        elif kind == highspy.cb.HighsCallbackType.kCallbackMipInterrupt:
            if not seen["presolved"]:
                seen["presolved"] = True
                open(presolved, "w").close()  # branch-and-bound has begun: presolve is over
            now = time.perf_counter()
            if now - seen["checked"] > 0.05:
                seen["checked"] = now
                if os.path.exists(stop_file):
                    data_in.user_interrupt = True
                if seen.get("bound") != out.mip_dual_bound:  # the proven bound, for a worker stopped at the deadline
                    seen["bound"] = out.mip_dual_bound
                    with open(bound_file + ".tmp", "w") as f:
                        f.write(repr(sense * out.mip_dual_bound))
                    os.replace(bound_file + ".tmp", bound_file)

    h.setCallback(on_event, None)
    h.startCallback(highspy.cb.HighsCallbackType.kCallbackMipImprovingSolution)
    h.startCallback(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    has = int(getattr(info, "primal_solution_status", 0)) == 2
    low = status.lower()
    if "infeasible" in low:
        state, has = "infeasible", False
    elif low == "optimal":
        state = "optimal"
    elif has:
        state = "time_limit" if ("time" in low or "interrupt" in low) else "feasible"
    else:
        state = "no_solution"
    meta = {
        "status": state,
        "has_solution": has,
        "objective": sense * float(info.objective_function_value) if has else None,
        "bound": sense * float(info.mip_dual_bound),
        "gap": float(info.mip_gap) if has else None,
        "solver_result": status,
    }
    x = np.array(h.getSolution().col_value) if has else np.zeros(0)
    np.savez(os.path.join(tmp, "result.tmp.npz"), meta=json.dumps(meta), x=x)
    os.replace(os.path.join(tmp, "result.tmp.npz"), os.path.join(tmp, "result.npz"))


if __name__ == "__main__":
    _worker(sys.argv[1])
