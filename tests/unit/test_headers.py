"""Every wire name lives in celery_durable/headers.py: each value pinned, and no other module spells one out."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from celery_durable import headers

PACKAGE = Path(__file__).resolve().parents[2] / "celery_durable"

#: What a worker of the previous release wrote and this one must still read: a change here is a wire change.
PINNED = {
    "RESUME_HEADER": "durable_resume",
    "STORE_WAITS_HEADER": "durable_store_waits",
    "SENT_AT_HEADER": "durable_sent_at",
    "KEY_HEADER": "durable_key",
    "WHEN_BUSY_HEADER": "durable_when_busy",
    "PARKED_FROM_HEADER": "x-durable-parked-from",
    "PARKED_REASON_HEADER": "x-durable-parked-reason",
    "TASK_NAME_HEADER": "task",
    "TASK_ID_HEADER": "id",
    "ETA_HEADER": "eta",
    "TASK_RETRIES_HEADER": "retries",
    "PARKED_SUFFIX": ".durable.parked",
    "HOLDERS_SUFFIX": ".durable_holders",
    "HELD_SUFFIX": ".durable_held.",
    "OUTBOX_CHANNEL": "durable_outbox",
    "LIMITS_CHANNEL": "durable_limits",
    "BROKER_CHANNEL": "durable_broker",
    "DASHBOARD_TOKEN_HEADER": "X-Durable-Token",
}

#: Celery's own names, too common a word ("id", "task") to look for elsewhere.
CELERYS = {"TASK_NAME_HEADER", "TASK_ID_HEADER", "ETA_HEADER", "TASK_RETRIES_HEADER"}

#: The same spelling meaning something else, each with why it is not a wire name spelt twice.
SAME_SPELLING = {
    # The task options (@app.durable_task(durable_key=...)) a call's header of the same name overrides.
    ("planning/limit_declarations.py", "durable_key"),
    ("planning/limit_declarations.py", "durable_when_busy"),
    # The outbox table, which the outbox's NOTIFY channel is named after.
    ("store/schema.py", "durable_outbox"),
}


def _constants() -> dict[str, str]:
    return {name: value for name, value in vars(headers).items() if name.isupper() and isinstance(value, str)}


def test_every_wire_name_is_pinned():
    assert _constants() == PINNED


def test_no_two_wire_names_share_a_spelling():
    values = list(_constants().values())
    assert len(values) == len(set(values))


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes in ``tree`` (a docstring may name a header: it is prose)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _spelt_out() -> list[tuple[str, int, str]]:
    # A whole name, not a prefix of another (durable_outbox_retention is a setting, not the channel).
    own = {value: re.compile(rf"(?<![\w-]){re.escape(value)}(?![\w-])")
           for name, value in _constants().items() if name not in CELERYS}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "headers.py" or "migrations" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        prose = _docstrings(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in prose:
                continue
            for value, spelt in own.items():
                if spelt.search(node.value) and (relative, value) not in SAME_SPELLING:
                    found.append((relative, node.lineno, value))
    return found


def test_no_other_module_spells_out_a_wire_name():
    assert _spelt_out() == []


@pytest.mark.parametrize("name", sorted(PINNED))
def test_each_wire_name_is_used_somewhere_in_the_package(name):
    users = [p for p in PACKAGE.rglob("*.py") if p.name != "headers.py" and name in p.read_text()]
    assert users, f"{name} is in headers.py but nothing uses it"
