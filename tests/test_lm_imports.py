"""The language-model package's import graph: no circles (every import statement counts, function-level and
TYPE_CHECKING ones included), the registry above the backends, the seam free of the engine, and the CUDA-only
decode graph imported only lazily by the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import runtime

ROOT = Path(runtime.__file__).parent
PACKAGES = ("runtime.models.lm", "runtime.models.vlm")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, dict[str, list[ast.stmt]]]:
    """module -> {imported module of these packages -> the import statements}."""
    graph: dict[str, dict[str, list[ast.stmt]]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT.parent / package.replace(".", "/")).glob("*.py")):
            name = _module(path)
            edges = graph.setdefault(name, {})
            for node in ast.walk(ast.parse(path.read_text())):
                targets: list[str] = []
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
                for target in targets:
                    if target.startswith(PACKAGES) and (ROOT.parent / (target.replace(".", "/") + ".py")).is_file():
                        edges.setdefault(target, []).append(node)
    return graph


def test_no_import_circles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path[path.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_seams_and_boundaries() -> None:
    graph = _graph()
    lm = "runtime.models.lm"
    importers = {m for m, edges in graph.items() if f"{lm}.registry" in edges}
    assert importers <= {lm}, f"only the package imports the registry, not {importers - {lm}}"
    for module in (f"{lm}.backend", f"{lm}.pieces", f"{lm}.prompt", f"{lm}.sampling"):
        assert f"{lm}.engine" not in graph[module], f"{module} must not import the engine"
    users = {m: stmts for m, edges in graph.items() for t, stmts in edges.items() if t == f"{lm}.cuda_graph"}
    assert set(users) == {f"{lm}.engine"}, f"the CUDA-only decode graph is imported by {set(users)}"
    engine = ast.parse((ROOT / "models/lm/engine.py").read_text())
    top_level = [n for n in engine.body if isinstance(n, ast.ImportFrom) and n.module == f"{lm}.cuda_graph"]
    assert not top_level, "the engine imports cuda_graph at module level"
