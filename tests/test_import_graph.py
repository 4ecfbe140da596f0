"""The package's layering, read from the source (every import, ``TYPE_CHECKING`` ones too):
the store does not know the pool or the server, the pool does not know the server, and no two
of the three import each other (issue 18: the composition root is ``kvtierd.server.assembly``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvtierd

PACKAGE = Path(kvtierd.__file__).parent
LAYERS = ("store", "pool", "server")


def _imports(path: Path) -> set[str]:
    """The kvtierd modules ``path`` imports, absolute (``kvtierd.pool.link``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {name for name in names if name.startswith("kvtierd.")}


def _package_edges() -> dict[str, set[str]]:
    """Which of :data:`LAYERS` each layer's modules import."""
    edges: dict[str, set[str]] = {layer: set() for layer in LAYERS}
    for layer in LAYERS:
        for path in (PACKAGE / layer).rglob("*.py"):
            for name in _imports(path):
                target = name.split(".")[1]
                if target in LAYERS and target != layer:
                    edges[layer].add(target)
    return edges


def test_the_import_reader_sees_imports() -> None:
    # the rule below would pass on a reader that found nothing: check it finds a known edge
    assert "store" in _package_edges()["pool"]


@pytest.mark.parametrize(
    ("layer", "forbidden"), [("store", {"pool", "server"}), ("pool", {"server"})]
)
def test_lower_layers_do_not_import_upper_ones(layer: str, forbidden: set[str]) -> None:
    offenders = {
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in (PACKAGE / layer).rglob("*.py")
        for name in _imports(path)
        if name.split(".")[1] in forbidden
    }
    assert not offenders


def test_no_circle_among_store_pool_and_server() -> None:
    edges = _package_edges()

    def reaches(start: str, goal: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(
            nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt}))
            for nxt in edges[start]
        )

    assert not [layer for layer in LAYERS if reaches(layer, layer)]


# -- module by module (issue 33): no circle of modules, TYPE_CHECKING imports included -----


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("kvtierd", *path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _module_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """The package's modules each module imports. ``from X import Y`` counts as importing
    ``X.Y`` where that is a module (``from kvtierd.client import ops``), else ``X``; relative
    imports are resolved."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([base] if base else [])])
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        edges[name] = {target for target in found if target in modules and target != name}
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``edges``: its strongly connected parts of two modules or more
    (Tarjan's algorithm), each sorted."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            part = []
            while True:
                member = stack.pop()
                part.append(member)
                if member == node:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for node in sorted(edges):
        if node not in order:
            visit(node)
    return circles


def test_the_circle_finder_finds_circles() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert _circles(edges) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_module_reader_resolves_imports() -> None:
    edges = _module_edges(_modules())
    assert "kvtierd.store.tier" in edges["kvtierd.store.nvme"]
    assert "kvtierd.client.ops" in edges["kvtierd.client.base"]  # from kvtierd.client import ops
    assert "kvtierd.client" not in edges["kvtierd.client.base"]


def test_no_module_imports_itself_through_others() -> None:
    assert _circles(_module_edges(_modules())) == []


# -- tools/ and tests/ (issue 33): what both need lives in kvtierd.testing ---------------------

ROOT = PACKAGE.parent


def _top_imports(path: Path) -> set[str]:
    """The top-level packages ``path`` imports (absolute imports only)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(("folder", "other"), [("tests", "tools"), ("tools", "tests")])
def test_tools_and_tests_import_neither_each_other(folder: str, other: str) -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / folder).rglob("*.py")
        if other in _top_imports(path)
    ]
    assert not offenders


def test_the_tools_tests_import_the_tools() -> None:
    # the rule above would pass on a reader that found nothing: check it finds a known import
    assert "tools" in _top_imports(ROOT / "tools" / "tests" / "test_benchlib.py")
