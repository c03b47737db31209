"""No import circles anywhere in the product (the layout rule): the import graph of every module
under core/, effects/, runtime/ and kernels/ — imports at module level and inside functions, the
names of ``from package import module`` resolved to the module — has no cycle. Imports under
``if TYPE_CHECKING:`` are annotations only and never run, so they are left out."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("core", "effects", "runtime", "kernels")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = ["fxsched", *path.relative_to(ROOT).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _annotation_only(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skipped


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules it imports, from {module: (source, is_package)}."""
    graph: dict[str, set[str]] = {}
    for name, (source, is_package) in sources.items():
        tree = ast.parse(source)
        skipped = _annotation_only(tree)
        here = name if is_package else name.rsplit(".", 1)[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                base = here
                for _ in range(max(node.level - 1, 0)):
                    base = base.rsplit(".", 1)[0]
                module = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    targets.add(sub if sub in sources else module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in sources and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
    return found


def test_the_finder_sees_a_circle_through_a_function_level_import_and_not_through_type_checking():
    sources = {
        "p": ("", True),
        "p.a": ("from p import b\n", False),
        "p.b": ("def f():\n    from p.c import x\n", False),
        "p.c": ("from .a import y\n", False),
        "p.d": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.e import z\n", False),
        "p.e": ("import p.d\n", False),
    }
    assert cycles(import_graph(sources)) == [["p.a", "p.b", "p.c"]]


def test_the_product_has_no_import_circle():
    sources = {name: (path.read_text(), path.name == "__init__.py") for name, path in _modules().items()}
    assert len(sources) > 200
    assert cycles(import_graph(sources)) == []
