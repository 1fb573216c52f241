"""The package's layout rules, checked on its source: no import circle, no private name
imported across modules, Lightning's private names in one module, one job per module.

The checks read the source with :mod:`ast` (no import side effects).  Every import counts,
module-level or inside a function: two modules that import each other are a circle either way.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "lightning_fullgraph"
BENCHMARKS = REPO / "benchmarks"
#: The one module allowed to import Lightning's private names (``lightning.*._x``).
LIGHTNING_PRIVATE_HOME = "lightning_fullgraph.launch.launchers"


def _modules(root: Path, prefix: str) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([prefix, *parts]) if prefix else ".".join(parts)] = path
    return out


def _imports(path: Path, name: str, known: set[str]) -> list[tuple[str, str, int]]:
    """``(imported module, imported name or "", line)`` for every import of a known module."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub, "", node.lineno) if sub in known else (base, alias.name, node.lineno))
    return [(m, n, line) for m, n, line in out if m in known or any(m.startswith(k + ".") for k in ("lightning",))]


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    known = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target, _, _ in _imports(path, name, known):
            if target in known and target != name:
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_the_package_has_no_import_circle() -> None:
    """Negative control: ``from lightning_fullgraph.strategy import FullGraphStrategy`` inside
    a function of ``training.py`` (which the strategy imports) is reported as a circle."""
    graph = _graph(_modules(PACKAGE, "lightning_fullgraph"))
    for name in graph:
        # importing a submodule runs its package's __init__, which is not an edge of the module
        graph[name] -= _ancestors(name)
    assert _cycles(graph) == []


def test_the_benchmarks_have_no_import_circle() -> None:
    """Negative control: ``bench_scale.py``'s old ``import run as bench_run`` (run.py imports
    bench_scale) is reported."""
    assert _cycles(_graph(_modules(BENCHMARKS, ""))) == []


def test_no_private_name_is_imported_across_modules() -> None:
    """``from lightning_fullgraph.x import _y`` only inside ``x`` itself (tests excluded: they
    may reach into a module they test).

    Negative control: the old ``from lightning_fullgraph.nn.adapters import _check_installable``
    in preflight is reported."""
    modules = _modules(PACKAGE, "lightning_fullgraph")
    known = set(modules)
    crossing = []
    for name, path in modules.items():
        for target, imported, line in _imports(path, name, known):
            if target.startswith("lightning_fullgraph") and target != name and (
                imported.startswith("_") or any(p.startswith("_") and p != "__init__" for p in target.split(".")[1:])
            ):
                if target in ("lightning_fullgraph._os", "lightning_fullgraph._warnings") and not imported.startswith("_"):
                    continue  # private MODULES of the package, public names inside it
                crossing.append(f"{path.relative_to(REPO)}:{line}: {target} {imported}")
    assert crossing == []


def test_lightning_private_names_are_imported_in_one_module() -> None:
    """Lightning's private names (a ``_`` module or name under ``lightning``) are imported only
    by :data:`LIGHTNING_PRIVATE_HOME`, which pins them for one Lightning version range.

    Negative control: ``from lightning.pytorch.overrides.distributed import
    _sync_module_states`` in strategy.py (where it was) is reported."""
    modules = _modules(PACKAGE, "lightning_fullgraph")
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning":
                private = [a.name for a in node.names if a.name.startswith("_")]
                if any(p.startswith("_") for p in node.module.split(".")) or private:
                    found.append((name, f"{path.relative_to(REPO)}:{node.lineno}: {node.module} {private}"))
    assert {name for name, _ in found} <= {LIGHTNING_PRIVATE_HOME}, [where for _, where in found]


def test_every_module_says_its_one_job_in_a_first_line() -> None:
    """Every module starts with a docstring whose first line is one sentence.

    Negative control: a module without a docstring, or whose first line runs on to a second
    line, is named."""
    bad = []
    for name, path in _modules(PACKAGE, "lightning_fullgraph").items():
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        lines = (doc or "").lstrip("\n").split("\n")
        if not lines[0].strip() or (len(lines) > 1 and lines[1].strip()):
            bad.append(name)
    assert bad == []
