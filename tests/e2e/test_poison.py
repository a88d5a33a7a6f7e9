"""Poison messages between good tasks, on real workers: parked and logged, the worker alive, the good tasks run."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from kombu import Connection

from celery_durable.broker.sqlite_rows import stamp
from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.store.engine import ensure_schema
from celery_durable.worker.parking import parked_name
from tests.conftest import ALL_BROKERS
from tests.e2e.harness import Scenario, wait_for
from tests.services import redis_problem, require

NOT_JSON = b"{this is not json"
# A kombu Redis envelope whose body is not base64 (incorrect padding).
NOT_BASE64 = (b'{"body": "abc", "content-encoding": "utf-8", "content-type": "application/json", '
              b'"headers": {}, "properties": {"body_encoding": "base64", "delivery_tag": "poison-tag", '
              b'"delivery_info": {"exchange": "", "routing_key": "x"}, "priority": 0}}')
#: Far beyond how long the good tasks may take: they must not wait for a redelivery.
VISIBILITY_TIMEOUT = 60
PROMPT = 15.0


def _push_poison(s: Scenario, queue: str) -> int:
    """Put undecodable items on ``queue`` as the broker stores them; how many were put."""
    if s.broker_kind == "redis":
        redis.Redis.from_url(s.broker_url).lpush(queue, NOT_JSON, NOT_BASE64)
        return 2
    if s.broker_kind == "rabbitmq":
        with Connection(s.broker_url) as conn:
            producer = conn.Producer()
            producer.publish(NOT_JSON, routing_key=queue, content_type="application/json",
                             content_encoding="utf-8")
            producer.publish(b"\x00", routing_key=queue, content_type="application/x-nobody-accepts",
                             content_encoding="binary")
        return 2
    if s.broker_kind in ("postgresql", "sqlite"):
        # Rows no kombu publish would write: one not JSON, one JSON with no properties.
        engine = ensure_schema(s.broker_url.removeprefix("durable+"))
        now = stamp(SYSTEM_CLOCK.now()) if engine.dialect.name == "sqlite" else None
        with engine.begin() as conn:
            for payload in (NOT_JSON.decode(), '{"body": "abc"}'):
                conn.execute(sa.text("INSERT INTO durable_broker_messages (queue, priority, payload, enqueued_at, "
                                     "visible_at) VALUES (:q, 0, :p, coalesce(:now, CURRENT_TIMESTAMP), "
                                     "coalesce(:now, CURRENT_TIMESTAMP))"), {"q": queue, "p": payload, "now": now})
        return 2
    with Connection(s.broker_url) as conn:
        channel = conn.channel()
        obj = channel._get_or_create(queue)
        channel.session.add(channel.message_cls(NOT_JSON, obj))
        channel.session.commit()
    return 1


def _push_unreadable_task(s: Scenario, queue: str) -> None:
    """A message that decodes, names a registered task, but whose body is not [args, kwargs, embed]."""
    with Connection(s.broker_url) as conn:
        conn.Producer().publish("not a task body", routing_key=queue, serializer="json",
                                headers={"task": "e2e.record", "id": str(uuid.uuid4()), "lang": "py"})


def _parked(s: Scenario, queue: str) -> int:
    target = parked_name(queue)
    if s.broker_kind == "redis":
        return int(redis.Redis.from_url(s.broker_url).llen(target))
    with Connection(s.broker_url) as conn:
        if s.broker_kind == "rabbitmq":
            try:
                _, count, _ = conn.default_channel.queue_declare(queue=target, passive=True)
            except conn.channel_errors:
                return 0
            return int(count)
        return int(conn.default_channel._size(target))


def _cleanup_parked(s: Scenario) -> None:
    for queue in s.queues:
        if s.broker_kind == "redis":
            redis.Redis.from_url(s.broker_url).delete(parked_name(queue))
        elif s.broker_kind == "rabbitmq":
            with Connection(s.broker_url) as conn:
                conn.default_channel.queue_delete(parked_name(queue))


def _poison_between_good_tasks(s: Scenario) -> None:
    queue = s.by_name["q"]
    # The SQLAlchemy transport hands its options to create_engine, and has no visibility timeout.
    conf = {} if s.broker_kind == "sqla" else {"broker_transport_options": {"visibility_timeout": VISIBILITY_TIMEOUT}}
    # Queued before the worker starts: the first claim pass takes the poison in one ask with good tasks.
    s.send("q", "before1")
    pushed = _push_poison(s, queue)
    _push_unreadable_task(s, queue)
    s.send("q", "before2")
    worker = s.worker(conf=conf, concurrency=2).wait_ready()
    began = time.monotonic()
    s.wait_ended(2, timeout=PROMPT)
    # Sent to an idle worker: the idle wait's delivery meets the poison first.
    pushed += _push_poison(s, queue)
    s.send("q", "after1")
    s.send("q", "after2")
    s.wait_ended(4, timeout=PROMPT)
    assert time.monotonic() - began < PROMPT
    assert sorted(e["label"] for e in s.ended()) == ["after1", "after2", "before1", "before2"]
    wait_for(lambda: _parked(s, queue) == pushed + 1, timeout=10, what=f"{pushed + 1} parked messages")
    assert worker.process.poll() is None, f"the worker exited:\n{worker.log()[-3000:]}"
    log = worker.log()
    assert log.count(f"durable.message.parked queue={queue} ") == pushed + 1, log[-3000:]
    assert "this is not json" in log
    if s.broker_kind != "sqla":
        assert s.broker_depth("q") == 0
    assert worker.terminate() == 0


@pytest.mark.parametrize("broker", ALL_BROKERS, indirect=True)
def test_poison_is_parked_and_the_worker_runs_every_good_task(scenario):
    s = scenario(["q"])
    try:
        _poison_between_good_tasks(s)
    finally:
        _cleanup_parked(s)


def test_poison_on_the_embedded_broker_is_parked_and_the_worker_runs_on(tmp_path: Path):
    require("Redis (observation)", redis_problem())
    s = Scenario("sqla", f"sqla+sqlite:///{tmp_path}/broker.sqlite", ["q"])
    try:
        _poison_between_good_tasks(s)
    finally:
        for worker in s._workers:
            worker.kill()
        s.observer.delete(s.key)


def test_arguments_holding_a_lone_surrogate_are_a_good_task_not_poison(scenario):
    """Celery sends them (its ``argsrepr`` header keeps the character, JSON-escaped); a stock worker runs
    them, and so must ``-P durable``, whose Redis claim script once read the escape as "not JSON"."""
    s = scenario(["q"])
    worker = s.worker().wait_ready(60)
    try:
        ids = [s.send("q", "lone \ud800 high"), s.send("q", "lone \udfff low"), s.send("q", "plain")]
        ended = wait_for(lambda: len(s.ended()) >= 3 and s.ended(), timeout=PROMPT, what="all three tasks to end")
        assert sorted(e["id"] for e in ended) == sorted(ids)
        assert sorted(e["label"] for e in ended) == sorted(["lone \ud800 high", "lone \udfff low", "plain"])
        assert "durable.message.parked" not in worker.log()
    finally:
        _cleanup_parked(s)
