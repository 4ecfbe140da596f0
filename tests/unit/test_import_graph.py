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
