"""Imports run one way: no module of a package imports, directly or through others, a module that imports it.

The graph is read from the source with ast, not by importing: every `import` / `from ... import` statement
counts, at module level and inside functions alike (a deferred import still ties the two modules together).
Only imports under `if TYPE_CHECKING:` are left out: a type checker reads them, the interpreter never runs them.
A `from package import name` counts as an import of `package.name` when that is a module of the package, else of
`package` (its __init__).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# One line per package whose modules must not import each other in a circle.
PACKAGES = [
    pytest.param("device", id="device"),
    pytest.param("swapopt", id="swapopt"),
]


def _modules(package: str) -> dict[str, Path]:
    """Dotted name -> source file, for every module of `package` (a package is its __init__)."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in `tree`, at any depth, except those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from` statement names (relative imports resolved against `module`)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _resolve(name, is_package, node)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in modules else source)
            for target in targets:
                # `import a.b.c` imports a, a.b and a.b.c; the deepest module of the package is the one named.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as [a, b, ..., a], or None (depth-first search, in name order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_reports_a_circle_and_passes_a_layered_graph() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_counts_deferred_imports_and_skips_type_checking_ones(tmp_path: Path, monkeypatch) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from pkg import high\n")
    (pkg / "high.py").write_text(
        "from typing import TYPE_CHECKING\nfrom . import low\nif TYPE_CHECKING:\n    from pkg.other import X\n"
    )
    (pkg / "other.py").write_text("import pkg.high\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = import_graph("pkg")
    assert graph == {"pkg": set(), "pkg.low": {"pkg.high"}, "pkg.high": {"pkg.low"}, "pkg.other": {"pkg.high"}}
    assert find_cycle(graph) == ["pkg.high", "pkg.low", "pkg.high"]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circles(package: str) -> None:
    cycle = find_cycle(import_graph(package))
    assert cycle is None, f"import circle in {package}/: " + " -> ".join(cycle)
