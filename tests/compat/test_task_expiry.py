"""compat.task_expiry: a task's ``expires`` reaches the broker as its header only, never as a per-message TTL.

Pins the Celery behaviour it relies on: ``send_task_message`` publishes with the very ``properties`` dict it
handed ``before_task_publish`` (kombu's memory transport keeps each message's properties as published).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from celery import Celery

import celery_durable
from celery_durable.compat.task_expiry import TTL_PROPERTY


@pytest.fixture
def app() -> Iterator[Celery]:
    app = celery_durable.install(Celery("expiry", broker="memory://", set_as_current=False))
    yield app
    app.close()


def published(app: Celery, queue: str, send: int = 1) -> list:
    with app.connection_for_write() as conn:
        simple = conn.SimpleQueue(queue)
        messages = [simple.get(timeout=1) for _ in range(send)]
        for message in messages:
            message.ack()
        simple.close()
    return messages


def test_expires_in_seconds_or_as_a_datetime_stays_in_the_header_and_sets_no_broker_ttl(app: Celery) -> None:
    @app.task(name="expiry.noop", shared=False)
    def noop() -> None:  # pragma: no cover - never run here: the test reads the broker
        return None

    before = datetime.now().astimezone()
    noop.apply_async(queue="expiry-q", expires=30)
    app.send_task("expiry.noop", queue="expiry-q", expires=before + timedelta(minutes=5))
    first, second = published(app, "expiry-q", send=2)
    for message in (first, second):
        assert TTL_PROPERTY not in message.properties
    assert before + timedelta(seconds=29) < datetime.fromisoformat(first.headers["expires"]) \
        < before + timedelta(seconds=60)
    assert datetime.fromisoformat(second.headers["expires"]) == before + timedelta(minutes=5)


def test_a_ttl_the_caller_set_without_expires_is_kept(app: Celery) -> None:
    app.send_task("expiry.noop", queue="expiry-own", expiration=12.5)
    (message,) = published(app, "expiry-own")
    assert message.headers["expires"] is None
    assert message.properties[TTL_PROPERTY] == "12500"
