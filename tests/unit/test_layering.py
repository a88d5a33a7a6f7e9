"""The package's layers: each capability folder imports only from layers below it, and no module cycle exists."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "celery_durable"

#: Bottom first. A module may import from its own layer's other parts and from any layer below.
LAYERS: list[set[str]] = [
    {"errors", "faults", "headers", "clock", "shared_dir", "planning", "compat"},  # pure rules, wire names, the clock
    {"store"},                                    # SQLAlchemy Core over the durable store
    {"config"},                                   # validated settings (reads store.schema's backends)
    {"metrics"},                                  # the registry and every metric
    {"leases", "tasks", "outbox", "beat", "limits", "broker"},  # capabilities
    {"worker"},                                   # the -P durable pool, wiring the capabilities
    {"cli", "__init__", "testing"},               # the public surface (testing: the pytest plugin)
]
#: Pure layers import nothing of celery_durable but errors (and the wire names in headers).
PURE = {"planning": {"errors", "headers"}, "compat": {"errors", "headers"}, "errors": set(), "faults": set(),
        "headers": set(), "clock": set(), "shared_dir": set()}


def _part(module: str) -> str:
    """The top-level part (folder or module) of a ``celery_durable.*`` module name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(part: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Each package module and the celery_durable modules it imports (module-level and in functions)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        module = _module_of(path)
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("celery_durable"):
                for alias in node.names:
                    candidate = f"{node.module}.{alias.name}"
                    sub = PACKAGE.parent / Path(*candidate.split("."))
                    targets.add(candidate if sub.is_dir() or sub.with_suffix(".py").exists() else node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("celery_durable"))
        graph[module] = {t for t in targets if t != module}
    return graph


GRAPH = _imports()


def test_every_top_level_part_has_a_layer():
    parts = {_part(m) for m in GRAPH}
    assert parts <= set().union(*LAYERS), parts - set().union(*LAYERS)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_module_imports_from_a_layer_above_it(module):
    own = _part(module)
    upward = [t for t in GRAPH[module] if _layer(_part(t)) > _layer(own)]
    assert upward == [], f"{module} imports from above its layer: {upward}"
    if own in PURE:
        allowed = PURE[own] | {own}
        assert {_part(t) for t in GRAPH[module]} <= allowed, f"{module} imports {GRAPH[module]}"


def _third_party_imports(source: str) -> set[str]:
    """The top-level names of the modules ``source`` imports that are neither the standard library's nor ours."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(name.split(".")[0] for name in names)
    return {name for name in found if name not in sys.stdlib_module_names and name != "celery_durable"}


@pytest.mark.parametrize("path", sorted((PACKAGE / "planning").rglob("*.py")), ids=lambda p: p.name)
def test_planning_imports_only_the_standard_library_and_our_pure_layer(path):
    # Pure: planners are tested from tables, with no Celery, kombu or SQLAlchemy behind them.
    assert _third_party_imports(path.read_text()) == set()


def test_the_third_party_check_sees_an_import_in_any_form():
    source = ("import kombu.utils\nfrom celery.schedules import crontab\nimport json\nfrom . import x\n"
              "from celery_durable.errors import DurableError\n"
              "def f():\n    import sqlalchemy\n")
    assert _third_party_imports(source) == {"kombu", "celery", "sqlalchemy"}


def test_no_import_cycles():
    # Package __init__ re-exports are edges too: a cycle through one still breaks import order.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(GRAPH.get(node, ())):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)
    # The package root re-exports the public API from everything below it: its
    # edges back from submodules are Python's package import, not a cycle of ours.
    cycles = [c for c in cycles if "celery_durable" not in c]
    assert cycles == []
