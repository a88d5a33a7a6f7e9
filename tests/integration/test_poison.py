"""Poison messages on real brokers: parked beside their queue, the good ones of the same ask delivered."""

from __future__ import annotations

import base64
import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue

from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.worker.claimer import Claimer
from celery_durable.worker.fetchers import RedisFetcher, fetcher_for
from celery_durable.worker.held_runs import HeldRuns
from celery_durable.worker.parking import parked_name
from tests.e2e.harness import wait_for
from tests.services import AMQP_URL, REDIS_URL, amqp_problem, redis_problem, require

NOT_JSON = b"{this is not json"


def _redis_keys(name: str) -> list[str]:
    return [name, parked_name(name), *[f"{name}\x06\x16{p}" for p in (3, 6, 9)]]


@pytest.fixture
def redis_queue() -> Iterator[tuple[Any, Any, Queue]]:
    require("Redis", redis_problem())
    name = f"poison-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), routing_key=name)
    with Connection(REDIS_URL) as conn:
        channel = conn.channel()
        queue(channel).declare()
        yield conn, channel, queue
        redis.Redis.from_url(REDIS_URL).delete(*_redis_keys(name))


def publish(conn: Any, queue: Queue, *bodies: Any) -> None:
    producer = conn.Producer()
    for body in bodies:
        producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key,
                         serializer="json", declare=[queue])


def _envelope(body: str, encoding: str = "base64", content_type: str = "application/json") -> bytes:
    """A kombu Redis envelope as a producer writes it, with a body of our choosing."""
    return json.dumps({
        "body": body, "content-encoding": "utf-8", "content-type": content_type, "headers": {},
        "properties": {"body_encoding": encoding, "delivery_tag": str(uuid.uuid4()),
                       "delivery_info": {"exchange": "", "routing_key": "x"}, "priority": 0},
    }).encode()


# A body that is not base64: kombu's decode_body raises (incorrect padding).
NOT_BASE64 = _envelope("abc")


def test_redis_one_ask_delivers_the_good_messages_around_the_poison_and_parks_it(redis_queue, caplog):
    conn, channel, queue = redis_queue
    client = redis.Redis.from_url(REDIS_URL)
    publish(conn, queue, "good1")
    client.lpush(queue.name, NOT_JSON, NOT_BASE64)
    publish(conn, queue, "good2", "good3")

    with caplog.at_level(logging.WARNING, logger="celery_durable.worker.parking"):
        messages = list(RedisFetcher(channel, ["json"]).fetch(queue, 2, lambda: True))

    assert [m.decode() for m in messages] == ["good1", "good2"]
    assert client.lrange(parked_name(queue.name), 0, -1) == [NOT_BASE64, NOT_JSON]
    # The unacked hash is shared with every other worker on this Redis: look up tags, not sizes.
    for message in messages:
        assert client.hexists(channel.qos.unacked_key, message.delivery_tag)
        assert client.zscore(channel.qos.unacked_index_key, message.delivery_tag) is not None
    bad_tag = json.loads(NOT_BASE64)["properties"]["delivery_tag"]
    assert not client.hexists(channel.qos.unacked_key, bad_tag)
    assert client.zscore(channel.qos.unacked_index_key, bad_tag) is None
    assert client.llen(queue.name) == 1, "good3 was not asked for and stays queued"
    parked_logs = [r for r in caplog.records if r.getMessage().startswith("durable.message.parked")]
    assert len(parked_logs) == 2
    assert all(r.queue == queue.name for r in parked_logs)
    assert any("this is not json" in r.getMessage() for r in parked_logs)
    for message in messages:
        message.ack()


def test_redis_items_with_json_but_no_kombu_envelope_are_parked_by_the_script(redis_queue):
    conn, channel, queue = redis_queue
    client = redis.Redis.from_url(REDIS_URL)
    shapes = [b"42", b"null", b'"text"', b"[1, 2]", b'{"properties": 5}',
              b'{"properties": {"delivery_tag": 7, "delivery_info": {}}}',
              b'{"properties": {"delivery_tag": "t"}}']
    client.lpush(queue.name, *shapes)
    publish(conn, queue, "good")
    messages = list(RedisFetcher(channel, ["json"]).fetch(queue, 10, lambda: True))
    assert [m.decode() for m in messages] == ["good"]
    assert sorted(client.lrange(parked_name(queue.name), 0, -1)) == sorted(shapes)
    messages[0].ack()


# -- the claimer: its idle wait, and bodies Celery cannot decode, on Redis and RabbitMQ --------

class Recorder:
    def __init__(self) -> None:
        self.messages: list[Any] = []

    def __call__(self, message: Any) -> None:
        self.messages.append(message)
        message.ack()


def _claimer(conn: Any, queue: Queue, handler: Recorder) -> Claimer:
    scheduled: list[Any] = []
    claimer = Claimer(connection=conn, queues=lambda: [queue], held=HeldRuns(8, {queue.name: 8}),
                      accept=["json"], schedule=scheduled.append, clock=SYSTEM_CLOCK)
    claimer.handler = handler
    return claimer


def test_redis_idle_wait_parks_a_poison_item_and_delivers_the_next(redis_queue):
    conn, _, queue = redis_queue
    client = redis.Redis.from_url(REDIS_URL)
    handler = Recorder()
    claimer = _claimer(conn, queue, handler)
    try:
        # Nothing queued: the pass finds no work and arms the idle wait (a BRPOP consume).
        claimer.start()
        assert handler.messages == []
        client.lpush(queue.name, NOT_JSON)
        client.lpush(queue.name, NOT_BASE64)
        publish(conn, queue, "after")

        def drained() -> bool:
            try:
                conn.drain_events(timeout=0.2)
            except TimeoutError:
                pass
            return bool(handler.messages)

        wait_for(drained, timeout=10, what="the good message after the poison")
        assert [m.decode() for m in handler.messages] == ["after"]
        assert client.lrange(parked_name(queue.name), 0, -1) == [NOT_BASE64, NOT_JSON]
        assert client.llen(queue.name) == 0
    finally:
        claimer.close()


def _bad_bodies(conn: Any, queue: Queue) -> None:
    producer = conn.Producer()
    common = {"exchange": queue.exchange, "routing_key": queue.routing_key, "declare": [queue]}
    producer.publish(NOT_JSON, content_type="application/json", content_encoding="utf-8", **common)
    producer.publish(b"\x00\x01", content_type="application/x-nobody-accepts", content_encoding="binary", **common)


def test_redis_claimer_parks_bodies_celery_cannot_decode_and_admits_the_rest(redis_queue):
    conn, channel, queue = redis_queue
    client = redis.Redis.from_url(REDIS_URL)
    publish(conn, queue, "good1")
    _bad_bodies(conn, queue)
    publish(conn, queue, "good2")
    handler = Recorder()
    claimer = _claimer(conn, queue, handler)
    try:
        claimer.start()
        assert [m.decode() for m in handler.messages] == ["good1", "good2"]
        assert claimer.held.held() == 0
        parked = [json.loads(raw) for raw in client.lrange(parked_name(queue.name), 0, -1)]
        assert sorted(p["content-type"] for p in parked) == ["application/json", "application/x-nobody-accepts"]
        assert base64.b64decode(next(p for p in parked if p["content-type"] == "application/json")["body"]) == NOT_JSON
        tags = {p["properties"]["delivery_tag"] for p in parked}
        assert not any(client.hexists(channel.qos.unacked_key, tag) for tag in tags)
        assert client.llen(queue.name) == 0
    finally:
        claimer.close()


@pytest.fixture
def amqp_queue() -> Iterator[tuple[Any, Queue]]:
    require("RabbitMQ", amqp_problem())
    name = f"poison-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), routing_key=name, auto_delete=False)
    with Connection(AMQP_URL) as conn:
        queue(conn.default_channel).declare()
        yield conn, queue
    with Connection(AMQP_URL) as conn:
        conn.default_channel.queue_delete(name)
        conn.default_channel.queue_delete(parked_name(name))


def _depth(name: str) -> int:
    with Connection(AMQP_URL) as conn:
        _, count, _ = conn.default_channel.queue_declare(queue=name, passive=True)
        return int(count)


def test_rabbitmq_claimer_parks_bodies_celery_cannot_decode_and_admits_the_rest(amqp_queue):
    conn, queue = amqp_queue
    publish(conn, queue, "good1")
    _bad_bodies(conn, queue)
    publish(conn, queue, "good2")
    wait_for(lambda: _depth(queue.name) == 4, timeout=10, what="the four messages to be queued")
    handler = Recorder()
    with Connection(AMQP_URL) as worker_conn:
        claimer = _claimer(worker_conn, queue, handler)
        # One pass: the four are queued, and one ask (pipelined gets) takes them all.
        claimer.start()
        assert sorted(m.decode() for m in handler.messages) == ["good1", "good2"]
        assert claimer.held.held() == 0
        claimer.close()
    # The worker's connection is gone: anything it had left unacked would be back.
    assert _depth(queue.name) == 0
    with Connection(AMQP_URL) as conn2:
        parked_queue = Queue(parked_name(queue.name), durable=True, auto_delete=False)
        bound = parked_queue(conn2.default_channel)
        copies = []
        while (m := bound.get(no_ack=True, accept=["json"])) is not None:
            copies.append(m)
    assert sorted(m.content_type for m in copies) == ["application/json", "application/x-nobody-accepts"]
    bad_json = next(m for m in copies if m.content_type == "application/json")
    # py-amqp hands a utf-8 body over as text.
    assert bad_json.body == NOT_JSON.decode()
    assert bad_json.headers["x-durable-parked-from"] == queue.name
    assert "cannot decode" in bad_json.headers["x-durable-parked-reason"]
    assert all(m.properties["delivery_mode"] == 2 for m in copies)


# -- the embedded broker: kombu's SQLAlchemy transport -----------------------------------

def test_sqlalchemy_broker_parks_a_row_that_is_not_json_and_reads_on(tmp_path: Path):
    name = f"poison-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), routing_key=name)
    with Connection(f"sqla+sqlite:///{tmp_path}/broker.sqlite") as conn:
        publish(conn, queue, "good1")
        channel = conn.channel()
        # A row no kombu producer would write, as a foreign writer or a bad migration might.
        obj = channel._get_or_create(name)
        channel.session.add(channel.message_cls(NOT_JSON, obj))
        channel.session.add(channel.message_cls(NOT_BASE64, obj))
        channel.session.commit()
        publish(conn, queue, "good2")

        fetcher = fetcher_for(conn.channel(), ["json"])
        messages = list(fetcher.fetch(queue, 4, lambda: True))
        assert [m.decode() for m in messages] == ["good1", "good2"]
        for message in messages:
            message.ack()

        parked = channel._query_all(parked_name(name)).all()
        assert sorted(bytes(row.payload) for row in parked) == sorted([NOT_JSON, NOT_BASE64])
        assert all(row.visible for row in parked), "a parked row stays readable"
        assert channel._size(name) == 0
