"""The package layers of docs/architecture.md ("Layers"), read from the source's imports.

Every `import` counts, at module level or inside a function, under `TYPE_CHECKING` or not: a
lazy import is still a dependency. A module may import its own layer's package and the
layers below it, never one above it nor a sibling of its layer; and no modules import each
other in a loop, however long.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pdserve"

# Top to bottom; the packages (or modules) in one row are siblings that never import each
# other. `pdserve` is the top-level package's own `__init__.py` (its `LLM` is the engine's).
LAYERS = (
    ("pdserve.cli", "pdserve"),
    ("pdserve.launch",),
    ("pdserve.sim", "pdserve.bench"),
    ("pdserve.workload",),
    ("pdserve.server", "pdserve.router"),
    ("pdserve.engine", "pdserve.api"),
    ("pdserve.kv_store",),
    ("pdserve.kv_transfer",),
    ("pdserve.model", "pdserve.core"),
    ("pdserve.flags", "pdserve.fleet", "pdserve.ports", "pdserve.redaction"),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str) -> Iterator[tuple[str, int]]:
    """The pdserve modules `name` imports, each with the line of its import."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from a import b`: b is a module of a, or a name a defines.
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target, node.lineno


GRAPH = {name: dict(imported_modules(name)) for name in MODULES}


def layer_of(name: str) -> tuple[int, str]:
    """(row in LAYERS, the package or module of that row that holds `name`)."""
    for row, members in enumerate(LAYERS):
        for member in members:
            if member == "pdserve" and name != "pdserve":
                continue
            if name == member or name.startswith(member + "."):
                return row, member
    raise AssertionError(f"{name} is in no layer: place its package in LAYERS")


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


def test_imports_point_down():
    upward = []
    for name, imports in GRAPH.items():
        row, member = layer_of(name)
        for target, line in imports.items():
            target_row, target_member = layer_of(target)
            if target_row < row or (target_row == row and target_member != member):
                upward.append(f"{MODULES[name].relative_to(PACKAGE.parent)}:{line} -> {target}")
    assert not upward, "imports up or sideways:\n" + "\n".join(upward)


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components of more than one module (each an import loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return loops


def test_no_import_cycles():
    assert strongly_connected(GRAPH) == []


@pytest.mark.parametrize(
    ("graph", "loops"),
    [
        ({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}, [["a", "b", "c"]]),
        ({"a": {"b": 1}, "b": {}, "c": {"b": 1}}, []),
    ],
)
def test_a_loop_is_found(graph, loops):
    assert strongly_connected(graph) == loops


def test_a_lazy_import_is_read():
    """`launch.cli` imports its launchers inside `run`: still a dependency."""
    assert "pdserve.launch.local" in GRAPH["pdserve.launch.cli"]
