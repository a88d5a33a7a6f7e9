"""A task whose ``expires`` passes while it waits for a free slot ends REVOKED, as on stock Celery.

A ``-P durable`` worker buffers nothing: the message stays in the broker until a slot is free. Celery sends
``expires`` as RabbitMQ's per-message TTL too, and RabbitMQ drops an expired message unseen, leaving its
result PENDING forever; an app with celery_durable installed keeps the expiry in the ``expires`` header
only, so the worker receives the message and Celery marks it REVOKED (compat/task_expiry.py).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery.result import AsyncResult

import celery_durable
from tests.conftest import ALL_BROKERS
from tests.e2e.harness import wait_for
from tests.services import REDIS_URL

pytestmark = pytest.mark.parametrize("broker", ALL_BROKERS, indirect=True)

#: Seconds from sending the expiring task to its expiry: past the send, well short of the test's bounds.
EXPIRES_IN = 1.0


def test_a_task_expiring_while_every_slot_is_busy_ends_revoked_and_never_runs(scenario):
    s = scenario(["q"])
    celery_durable.install(s.producer)
    s.producer.conf.result_backend = REDIS_URL
    worker = s.worker(conf={"durable_max_in_flight": 1, "result_backend": REDIS_URL}, concurrency=1).wait_ready()
    s.send_waiting("q", "busy")
    wait_for(lambda: s.labelled("start", "busy"), timeout=20, what="the busy run to hold the only slot")
    expires = datetime.now(timezone.utc) + timedelta(seconds=EXPIRES_IN)
    expired = s.send("q", "expired", expires=expires)
    fresh = s.send("q", "fresh", expires=60)
    wait_for(lambda: datetime.now(timezone.utc) > expires + timedelta(seconds=0.5), timeout=10,
             what="the expiry to pass")
    # Still in the broker past its expiry (on RabbitMQ a per-message TTL would have dropped it by now).
    assert s.broker_depth("q") == 2
    s.open_gate()
    result = AsyncResult(expired, app=s.producer)
    wait_for(lambda: result.state == "REVOKED", timeout=20, what="the expired task to be marked REVOKED")
    wait_for(lambda: AsyncResult(fresh, app=s.producer).state == "SUCCESS", timeout=20,
             what="the task expiring in a minute to run")
    assert [e["label"] for e in s.started()] == ["busy", "fresh"]
    worker.wait_durable(lambda st: st["in_flight"] == 0, timeout=20, what="the slot back")
    wait_for(lambda: s.broker_depth("q") == 0, timeout=10, what="the expired message acked")
    assert worker.terminate() == 0
