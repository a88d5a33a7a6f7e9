"""Every log call in celery_durable carries structured fields: ``extra={"event": ..., ...}``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "celery_durable"

#: A message's ``name=`` label and the extra field that holds its value, where the two differ: ``id``
#: is a run's or a task's; ``url`` the store's shown URL; a count a message words in prose has its field.
FIELD_OF = {
    "id": {"run_id", "task_id"},
    "url": {"store"},
    "back": {"handing_back"},
    "durable_max_in_flight": {"max_in_flight"},
    "name": {"step"},
    "run": {"run_id"},
    "worker": {"declared"},
    "another": {"other"},
    "held": {"held", "running"},
}

#: The methods of a ``logging.Logger`` that write a record.
LEVELS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log"}


def _names_event(extra: ast.expr | None, module: ast.Module) -> bool:
    """A dict literal with an ``event`` key, or a name the module assigns one to (``extra = {"event": ...}``)."""
    if isinstance(extra, ast.Name):
        assigned = [node.value for node in ast.walk(module) if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == extra.id for t in node.targets)]
        return bool(assigned) and all(_names_event(value, module) for value in assigned)
    return isinstance(extra, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "event" for k in extra.keys)


def _log_calls() -> list[tuple[str, ast.Call, ast.Module]]:
    """Each call of a logging method on a name that holds a logger (``logger``, ``log``, ``_logger``...)."""
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ast.parse(path.read_text())
        for node in ast.walk(module):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LEVELS
                    and isinstance(node.func.value, ast.Name) and "log" in node.func.value.id.lower()
                    and node.func.value.id != "logging"):
                calls.append((f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno}", node, module))
    return calls


def _extra(call: ast.Call) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == "extra"), None)


def test_the_scan_finds_the_log_calls():
    # A scan that finds nothing passes everything: the package logs in ~100 places.
    assert len(_log_calls()) >= 90


def test_every_log_call_passes_extra():
    assert [where for where, call, _ in _log_calls() if _extra(call) is None] == []


def test_every_extra_names_its_event():
    """An ``event`` key (the event name the message opens with), for log pipelines to key on."""
    assert [where for where, call, module in _log_calls() if not _names_event(_extra(call), module)] == []


def test_no_module_logs_through_the_root_logger():
    users = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LEVELS
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "logging"):
                users.append(f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno}")
    assert users == []


def _labels(call: ast.Call) -> list[str]:
    """The ``name=%s`` labels of the call's message (a literal, or a literal an expression opens with)."""
    message = next((a for a in call.args if not (isinstance(a, ast.Name) and a.id == "level")), None)
    while isinstance(message, ast.BinOp):
        message = message.left
    if not (isinstance(message, ast.Constant) and isinstance(message.value, str)):
        return []
    return re.findall(r"(\w+)=%", message.value)


def test_every_value_a_message_names_is_a_field():
    unnamed = []
    for where, call, _ in _log_calls():
        extra = _extra(call)
        if not isinstance(extra, ast.Dict):
            continue  # a name built elsewhere (store_outage's extra holds its fields)
        keys = {k.value for k in extra.keys if isinstance(k, ast.Constant)}
        unnamed += [f"{where} {label}" for label in _labels(call)
                    if label not in keys and not FIELD_OF.get(label, set()) & keys]
    assert unnamed == []
