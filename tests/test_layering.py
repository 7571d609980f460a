"""The package's structure, computed from its own imports (every `import` / `from ... import` in ``lazytrain_hf``,
inside functions and ``if TYPE_CHECKING:`` blocks too), so the rules cannot drift from the code:

- no import cycles (strongly connected components of the module graph);
- no import from a lower floor to a higher one (`FLOORS`, low to high);
- no private name (``_x``) imported from another module;
- no module over `MAX_LINES` lines (a module that long holds more than one concept).

Violations that exist today are listed in `KNOWN` (they are being moved by the lead and other branches). For each
rule, ``test_no_*`` asserts that there are none and is an expected failure (``xfail(strict=True)``) while `KNOWN`
lists any: once the last one is fixed it passes, strict xfail reports that as a failure, and its entry in `KNOWN`
(hence the mark) must go. ``test_*_known`` asserts that the violations are exactly `KNOWN`: a new one fails at once,
and a fixed one must be removed from the list.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lazytrain_hf"
MAX_LINES = 700

# Floors, low to high: a module may import from its own floor (without cycles) and from the floors below it.
#   base:        host-side helpers with no notion of training (byte units, registered host memory, threads, copy
#                lanes, the model-family table);
#   optim:       the Hybrid 8-bit optimizer, its kernels and the clip coefficient;
#   planner:     plans as data, the cost model, the MILP and its baselines, hardware profiles, the simulator;
#   executor:    the layer-streaming executor and the activation engine, which execute a plan;
#   training:    what LazyTrainer does around the executor: planning at train() start, checkpoints, the
#                layer-wise optimizer step, loading a model whose layers stay on disk;
#   trainer:     the HF-facing classes: LazyTrainingArguments, LazyTrainer, the TRL integration;
#   application: the command line, the package's public face, and the recipe's data and metric.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("units", "pinned", "threads", "streams", "models", "weight_layout")),
    ("optim", ("optim",)),
    ("planner", ("planner",)),
    ("executor", ("activations", "streaming")),
    ("training", ("training", "loading")),
    ("trainer", ("args", "trainer", "trl")),
    ("application", ("cli", "data", "metrics", "")),  # "": the package's __init__
]

# Violations present today (module names relative to the package). See the module docstring.
KNOWN: dict[str, set[str]] = {
    "cycles": set(),
    "upward": set(),
    "private": set(),
    "size": set(),
}


# ------------------------------------------------------------------------------------------------ the import graph


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package by its ``__init__``)."""
    mods = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _short(name: str) -> str:
    return name[len(PACKAGE) + 1 :] if name != PACKAGE else ""


def _owner(name: str) -> str:
    """The package module that ``name`` (a module, or a module plus an attribute) resolves to."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports() -> list[tuple[str, str, str | None, int]]:
    """``(importer, imported module, imported name or None, line)`` for every import of a package module."""
    found = []
    for mod, path in MODULES.items():
        is_pkg = path.name == "__init__.py"
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                        found.append((mod, _owner(alias.name), None, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base != PACKAGE and not base.startswith(PACKAGE + "."):
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in MODULES:  # `from pkg import submodule`
                        found.append((mod, full, None, node.lineno))
                    else:
                        found.append((mod, _owner(base), alias.name, node.lineno))
    return [f for f in found if f[1] != f[0]]


IMPORTS = _imports()


def _floor(mod: str) -> int:
    short = _short(mod)
    best, best_len = None, -1
    for level, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (short == p or short.startswith(p + ".") or p == "") and len(p) > best_len:
                if p == "" and short != "":
                    continue
                best, best_len = level, len(p)
    if best is None:
        raise AssertionError(f"module {mod} is on no floor: add it to FLOORS in tests/test_layering.py")
    return best


def cycles() -> set[str]:
    """Strongly connected components of more than one module (Tarjan), as ``"a <-> b <-> c"`` (sorted)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for src, dst, _, _ in IMPORTS:
        graph[src].add(dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            sccs.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return {" <-> ".join(sorted(_short(m) for m in c)) for c in sccs if len(c) > 1}


def upward() -> set[str]:
    return {
        f"{_short(src)} -> {_short(dst)}" for src, dst, _, _ in IMPORTS if _floor(src) < _floor(dst)
    }  # fmt: skip


def private() -> set[str]:
    return {
        f"{_short(src)} imports {_short(dst)}.{name}"
        for src, dst, name, _ in IMPORTS
        if name is not None and name.startswith("_") and not name.startswith("__")
    }


def oversized() -> dict[str, int]:
    sizes = {_short(m): len(p.read_text().splitlines()) for m, p in MODULES.items()}
    return {m: n for m, n in sizes.items() if n > MAX_LINES}


FOUND = {"cycles": cycles, "upward": upward, "private": private, "size": lambda: set(oversized())}
DETAIL = {"size": lambda: "; ".join(f"{m}: {n} lines" for m, n in sorted(oversized().items()))}


def _xfail_while_known(rule: str):
    known = sorted(KNOWN[rule])
    return pytest.mark.xfail(
        bool(known), strict=True, reason=f"{len(known)} known {rule} violation(s) still to fix: {'; '.join(known)}"
    )


# ------------------------------------------------------------------------------------------------ the rules


@_xfail_while_known("cycles")
def test_no_import_cycles():
    assert cycles() == set()


@_xfail_while_known("upward")
def test_no_upward_imports():
    assert upward() == set()


@_xfail_while_known("private")
def test_no_private_names_across_modules():
    assert private() == set()


@_xfail_while_known("size")
def test_no_module_over_max_lines():
    assert oversized() == {}, DETAIL["size"]()


@pytest.mark.parametrize("rule", sorted(FOUND))
def test_violations_are_exactly_the_known_ones(rule):
    found = FOUND[rule]()
    new, fixed = sorted(found - KNOWN[rule]), sorted(KNOWN[rule] - found)
    assert not new, f"new {rule} violation(s): {new} {DETAIL.get(rule, lambda: '')()}"
    assert not fixed, f"fixed {rule} violation(s): remove {fixed} from KNOWN in tests/test_layering.py"


# ------------------------------------------------------------------------------------------------ the checker itself


def test_every_module_is_on_a_floor_and_the_graph_is_read():
    assert {_floor(m) for m in MODULES} <= set(range(len(FLOORS)))
    assert len(MODULES) > 50 and len(IMPORTS) > 100
    # edges the checker must see: a relative import, a `from pkg import submodule`, an import inside a function
    edges = {(_short(s), _short(d)) for s, d, _, _ in IMPORTS}
    assert ("planner.costmodel", "planner.memterms") in edges
    assert ("training.planning", "planner.milp") in edges  # `from ..planner import ... milp` inside make_plan
    assert ("planner.probes", "optim") in edges  # `from lazytrain_hf.optim import HybridAdamW8bit` in a function


def test_the_checks_catch_what_they_look_for(monkeypatch, tmp_path):
    """A made-up package with one violation of each rule is reported as such."""
    pkg = tmp_path / PACKAGE
    (pkg / "planner").mkdir(parents=True)
    (pkg / "streaming").mkdir()
    for d in (pkg, pkg / "planner", pkg / "streaming"):
        (d / "__init__.py").write_text("")
    (pkg / "planner" / "a.py").write_text("def f():\n    from ..streaming.b import g\n")  # upward, in a function
    (pkg / "streaming" / "b.py").write_text("from ..planner.a import f\nfrom .c import _hidden\n")
    (pkg / "streaming" / "c.py").write_text("import lazytrain_hf.streaming.b\n" + "x = 1\n" * MAX_LINES)
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "ROOT", tmp_path)
    monkeypatch.setattr(this, "MODULES", _modules())
    monkeypatch.setattr(this, "IMPORTS", _imports())
    assert cycles() == {"planner.a <-> streaming.b <-> streaming.c"}
    assert upward() == {"planner.a -> streaming.b"}
    assert private() == {"streaming.b imports streaming.c._hidden"}
    assert oversized() == {"streaming.c": MAX_LINES + 1}


# ------------------------------------------------------------------------------------------------ docs/ARCHITECTURE.md

NOTE_RE = re.compile(r"Note: \[([^\]]+)\]")


def _code_notes() -> dict[str, set[str]]:
    """Title of every named Note in the package -> the files (relative to the package) that mention it."""
    notes: dict[str, set[str]] = {}
    for path in sorted((ROOT / PACKAGE).rglob("*")):
        if path.suffix in (".py", ".c"):
            for raw in NOTE_RE.findall(path.read_text()):
                title = re.sub(r'[\s#"]+', " ", raw).strip()  # a title wrapped over comment or string lines
                if not title.endswith("..."):  # abbreviated
                    notes.setdefault(title, set()).add(str(path.relative_to(ROOT / PACKAGE)))
    return notes


def test_notes_index_matches_the_code():
    """The Notes index of docs/ARCHITECTURE.md lists exactly the Notes of the code, each with a module that
    mentions it."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    rows = dict(re.findall(r"^\| \[([^\]]+)\] \| `([^`]+)` \|", doc, re.MULTILINE))
    code = _code_notes()
    missing = {t: sorted(code[t]) for t in sorted(set(code) - set(rows))}
    assert not missing, f"Notes missing from docs/ARCHITECTURE.md's index (title: files): {missing}"
    stale = sorted(set(rows) - set(code))
    assert not stale, f"Notes in docs/ARCHITECTURE.md's index that the code no longer has: {stale}"
    wrong = {t: (home, sorted(code[t])) for t, home in rows.items() if home not in code[t]}
    assert not wrong, f"index rows naming a module that does not mention the Note (title: named, actual): {wrong}"
