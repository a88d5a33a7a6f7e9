"""broker.rows.is_transient: which messages the PostgreSQL broker commits without waiting for the WAL flush."""

from __future__ import annotations

from celery_durable.broker.rows import is_transient


def test_only_a_message_sent_with_delivery_mode_1_is_transient() -> None:
    assert is_transient({"properties": {"delivery_mode": 1}})
    assert not is_transient({"properties": {"delivery_mode": 2}})  # Celery's tasks: persistent
    assert not is_transient({"properties": {}})
    assert not is_transient({"body": "no properties"})
