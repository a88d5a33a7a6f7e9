"""Every log call in celery_durable carries structured fields: ``extra={"event": ..., ...}``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "celery_durable"

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
