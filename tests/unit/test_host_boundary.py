"""Host internals (private or undocumented Celery/kombu/billiard/py-amqp names) are touched in compat/ only."""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_durable.compat.boundary import (
    HOST_NAMES_NOT_WRITTEN,
    HOST_PACKAGES,
    PRIVATE_NAMES_ALLOWED,
    UNDOCUMENTED_HOST_NAMES,
)

PACKAGE = Path(__file__).resolve().parents[2] / "celery_durable"
COMPAT = PACKAGE / "compat"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules_outside_compat() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if COMPAT not in p.parents and "migrations" not in p.parts)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_host_module(name: str | None) -> bool:
    return bool(name) and name.split(".")[0] in HOST_PACKAGES  # type: ignore[union-attr]


def _owner_is_own(node: ast.expr) -> bool:
    # self._x / cls._x are the object's own, unless the class extends a host class (checked apart).
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def violations(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text())
    yield from _name_violations(tree, str(path.relative_to(PACKAGE.parent)))
    yield from _host_subclass_violations(path, tree)


def _name_violations(tree: ast.Module, where: str) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if _is_private(node.attr) and not _owner_is_own(node.value) and node.attr not in PRIVATE_NAMES_ALLOWED:
                yield f"{where}:{node.lineno} reads ._{node.attr[1:]} of another object"
            if node.attr in UNDOCUMENTED_HOST_NAMES or node.attr == "__self__":
                yield f"{where}:{node.lineno} uses the undocumented host name {node.attr}"
            if node.attr in HOST_NAMES_NOT_WRITTEN and isinstance(node.ctx, (ast.Store, ast.Del)):
                yield f"{where}:{node.lineno} writes the host attribute {node.attr}"
        elif isinstance(node, ast.ImportFrom) and _is_host_module(node.module):
            for alias in node.names:
                if _is_private(alias.name) or alias.name in UNDOCUMENTED_HOST_NAMES:
                    yield f"{where}:{node.lineno} imports {alias.name} from {node.module}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
            key = node.args[1]
            if isinstance(key, ast.Constant) and isinstance(key.value, str) \
                    and (_is_private(key.value) or key.value in UNDOCUMENTED_HOST_NAMES or key.value == "__self__") \
                    and key.value not in PRIVATE_NAMES_ALLOWED:
                yield f"{where}:{node.lineno} looks up {key.value!r} by name"
            if node.func.id in ("setattr", "delattr") and isinstance(key, ast.Constant) \
                    and key.value in HOST_NAMES_NOT_WRITTEN:
                yield f"{where}:{node.lineno} writes the host attribute {key.value} by name"
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "__dict__":
            yield f"{where}:{node.lineno} reads an instance __dict__"


def _host_subclass_violations(path: Path, tree: ast.Module) -> Iterator[str]:
    """A class extending a host class may not override or use that class's private names."""
    module = importlib.import_module(_module_name(path))
    where = path.relative_to(PACKAGE.parent)
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(module, node.name, None)
        if not inspect.isclass(cls):
            continue
        host_bases = [base for base in cls.__mro__[1:] if _is_host_module(base.__module__)]
        if not host_bases:
            continue
        for inner in ast.walk(node):
            names: list[tuple[str, int]] = []
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.append((inner.name, inner.lineno))
            elif isinstance(inner, ast.Attribute) and _owner_is_own(inner.value):
                names.append((inner.attr, inner.lineno))
            for name, line in names:
                if not _is_private(name):
                    continue
                owner = next((base for base in host_bases if name in vars(base)), None)
                if owner is not None:
                    yield f"{where}:{line} {node.name} uses {owner.__module__}.{owner.__name__}.{name}"


@pytest.mark.parametrize("path", _modules_outside_compat(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_host_internals_outside_compat(path: Path) -> None:
    assert list(violations(path)) == []


def test_the_check_sees_each_kind_of_host_internal() -> None:
    # The walker must catch what it is for, or every module above passes vacuously.
    source = (
        'getattr(request, "_eta_timer_entry", None)\n'
        'channel._q_for_pri("q", 0)\n'
        'worker_state.should_stop\n'
        'from celery.canvas import _chain\n'
        'request.__dict__["_context"]\n'
        'callback.__self__\n'
        'self._own_name\n'
        'row._mapping\n'
        'worker.concurrency = 4\n'
        'setattr(request, "acknowledged", True)\n'
        'if request.acknowledged: pass\n'
        'with channel.conn_or_acquire() as client: pass\n'
    )
    found = list(_name_violations(ast.parse(source), "sample.py"))
    assert sorted(line.split(" ", 1)[0] for line in found) == [
        "sample.py:1", "sample.py:10", "sample.py:12", "sample.py:2", "sample.py:3", "sample.py:4", "sample.py:5",
        "sample.py:6", "sample.py:9"], found
