"""No import circles inside `runtime/`.

A circle means two modules cannot be read, tested or replaced apart, and it is how a registry ends up below
what it registers. Every import statement counts as an edge, wherever it stands: module level, inside a
function (a lazy import is still a dependency) and under `TYPE_CHECKING`. An import of a package's name that
is itself a submodule (`from runtime.models import tiny`) points at the submodule; any other name points at
the module that defines it. Python's implicit import of a parent package is not an edge: a package's
`__init__` re-exporting its submodules is not a circle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "runtime"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_edges(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of the same tree it imports."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base]) if base else ".".join(anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                while target and target not in files:  # `import a.b.c` where c is a name: the module a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_runtime_has_no_import_cycle() -> None:
    found = cycles(import_edges())
    assert not found, "import circles in runtime/:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_cycle_finder_sees_direct_lazy_and_long_circles(tmp_path: Path) -> None:
    pkg = tmp_path / "runtime"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from runtime.b import thing\n",
        "b.py": "def f():\n    from . import a\n",  # lazy and relative: still an edge
        "c.py": "import runtime.d\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runtime.sub.e import X\n",
        "sub/__init__.py": "from runtime.sub import e\n",  # a package re-exporting its submodule: no circle
        "sub/e.py": "from runtime import c\nfrom ..a import thing\n",
        "lone.py": "import os\nfrom runtime import sub\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    graph = import_edges(pkg)
    assert graph["runtime.b"] == {"runtime.a"}
    assert graph["runtime.sub.e"] == {"runtime.c", "runtime.a"}
    assert graph["runtime.lone"] == {"runtime.sub"}
    assert cycles(graph) == [["runtime.a", "runtime.b"], ["runtime.c", "runtime.d", "runtime.sub.e"]]
    assert cycles({"x": ["y"], "y": []}) == []


def test_registries_sit_above_their_backends_and_the_seams_stay_light() -> None:
    graph = import_edges()
    for package in ("runtime.models.asr", "runtime.models.lm"):
        registry = f"{package}.registry"
        inside = {m for m, targets in graph.items() if registry in targets and m.startswith(f"{package}.")}
        assert not inside, f"{registry} is imported by {inside}: a registry is used from above, never by a backend"
        backends = {t for t in graph[registry] if t.startswith(package)}
        assert backends, f"{registry} registers nothing"
        seam = f"{package}.base" if package.endswith("asr") else f"{package}.backend"
        assert not graph[seam] & backends, f"the seam {seam} imports a backend"
    lm = "runtime.models.lm"
    for module in (f"{lm}.backend", f"{lm}.pieces", f"{lm}.prompt", f"{lm}.sampling"):
        assert f"{lm}.engine" not in graph[module], f"{module} must not import the engine"


def test_the_cuda_only_decode_graph_is_imported_lazily_by_the_engine_session_alone() -> None:
    graph = import_edges()
    users = {m for m, targets in graph.items() if "runtime.models.lm.cuda_graph" in targets}
    assert users == {"runtime.models.lm.engine_session"}  # (the session records and runs the graph)
    engine = ast.parse((ROOT / "models/lm/engine_session.py").read_text())
    top_level = [n for n in engine.body if isinstance(n, ast.ImportFrom) and n.module == "runtime.models.lm.cuda_graph"]
    assert not top_level, "the engine session imports cuda_graph at module level: CPU users would load CUDA-only code"
