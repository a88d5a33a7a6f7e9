"""Celery's signals are connected in one place: worker/signals.py, and each install receiver only once."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from celery import Celery, signals

import celery_durable
from celery_durable.compat.task_expiry import keep_expiry_in_headers
from celery_durable.tasks.revocation import on_task_revoked
from celery_durable.tasks.sent_stamp import stamp

PACKAGE = Path(__file__).resolve().parents[2] / "celery_durable"


def _uses_celery_signals(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "celery" and any(
                a.name == "signals" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "celery.signals":
            return True
        if isinstance(node, ast.Import) and any(a.name == "celery.signals" for a in node.names):
            return True
    return False


def test_only_worker_signals_touches_celerys_signals():
    users = sorted(path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
                   if _uses_celery_signals(ast.parse(path.read_text())))
    assert users == ["worker/signals.py"]


def test_installing_twice_connects_each_receiver_once():
    celery_durable.install(Celery("signals-a"))
    celery_durable.install(Celery("signals-b"))
    # A receiver connected with a dispatch uid is keyed by it: once per process, however many apps.
    assert [key[0] for key, _ in signals.task_revoked.receivers].count("celery_durable.task_revoked") == 1
    assert [key[0] for key, _ in signals.before_task_publish.receivers].count("celery_durable.sent_stamp") == 1
    assert [key[0] for key, _ in signals.before_task_publish.receivers].count(
        "celery_durable.keep_expiry_in_headers") == 1


def test_the_install_receivers_are_the_revoke_cancel_the_sent_stamp_and_the_expiry_kept_in_headers():
    celery_durable.install(Celery("signals-c"))
    revoked = {key[0]: ref for key, ref in signals.task_revoked.receivers}
    published = {key[0]: ref for key, ref in signals.before_task_publish.receivers}
    assert revoked["celery_durable.task_revoked"] is on_task_revoked
    assert published["celery_durable.sent_stamp"] is stamp
    assert published["celery_durable.keep_expiry_in_headers"] is keep_expiry_in_headers


def _outcome_receivers(signal: Any) -> list[str]:
    return [key[0] for key, _ in signal.receivers if str(key[0]).startswith("celery_durable.task_outcomes.")]


def test_task_prerun_gets_a_receiver_only_where_task_success_lacks_the_runtime(monkeypatch: Any) -> None:
    """Celery's tracer sends task_prerun only if it has receivers: one the counts do not need costs each task."""
    from celery_durable.worker import signals as durable_signals

    monkeypatch.setattr(durable_signals, "success_carries_runtime", lambda: True, raising=False)
    durable_signals.connect_task_outcomes()
    assert _outcome_receivers(signals.task_prerun) == []
    assert _outcome_receivers(signals.task_success) == ["celery_durable.task_outcomes.on_success"]

    monkeypatch.setattr(durable_signals, "success_carries_runtime", lambda: False)
    durable_signals.connect_task_outcomes()
    try:
        assert _outcome_receivers(signals.task_prerun) == ["celery_durable.task_outcomes.on_prerun"]
    finally:
        signals.task_prerun.disconnect(dispatch_uid="celery_durable.task_outcomes.on_prerun")
