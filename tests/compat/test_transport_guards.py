"""compat.transport_guards: kombu's virtual-transport reads, guarded, park a poison item and deliver the next one."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Queue

from celery_durable.compat.transport_guards import guard_channel, message_raw, put_raw
from celery_durable.worker.parking import POISON_POLICY, parked_name
from tests.compat.conftest import delete_redis_queues, unique
from tests.services import REDIS_URL, redis_problem, require

NOT_JSON = b"{this is not json"
DEADLINE = 5.0


def _queue(name: str) -> Queue:
    return Queue(name, Exchange(name), routing_key=name)


def _publish(conn: Connection, queue: Queue, body: Any) -> None:
    conn.Producer().publish(body, exchange=queue.exchange, routing_key=queue.routing_key, serializer="json",
                            declare=[queue], headers={"h": "v"}, priority=3)


def _drain_until(conn: Connection, got: list[Any], count: int) -> None:
    """Serve ``conn``'s idle wait until ``count`` messages came, or fail at the deadline."""
    deadline = time.monotonic() + DEADLINE
    while len(got) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"{count - len(got)} messages not delivered within {DEADLINE}s")
        try:
            conn.drain_events(timeout=min(remaining, 1.0))
        except TimeoutError:
            pass


@pytest.fixture
def sql_url(tmp_path: Path) -> str:
    """kombu's SQLAlchemy transport (the embedded broker) on a SQLite file of the test's own."""
    return f"sqla+sqlite:///{tmp_path / 'broker.db'}"


@pytest.mark.parametrize("transport", ["memory", "sqlalchemy"])
def test_message_raw_put_raw_round_trip_on_a_virtual_transport(transport: str, sql_url: str) -> None:
    url = "memory://" if transport == "memory" else sql_url
    source, target = _queue(unique("raw")), _queue(unique("raw"))
    with Connection(url) as conn:
        channel = conn.default_channel
        for queue in (source, target):
            queue(channel).declare()
        try:
            _publish(conn, source, {"n": 1})
            original = source(channel).get(no_ack=False)
            raw = message_raw(original)
            # The payload as the transport stored it: a kombu envelope.
            assert isinstance(raw, dict) and raw["properties"]["delivery_tag"] == original.delivery_tag

            put_raw(channel, target.name, raw)
            copy = target(channel).get(no_ack=True)
            assert copy is not None, "put_raw did not store the payload on the queue"
            assert copy.decode() == {"n": 1}
            assert copy.headers == original.headers == {"h": "v"}
            assert copy.content_type == original.content_type
            assert copy.properties["priority"] == 3
            assert message_raw(copy) == raw
            original.ack()
        finally:
            for queue in (source, target):
                channel.queue_delete(queue.name)


@pytest.mark.redis
def test_channel_brpop_read_guarded_parks_a_poison_item_and_delivers_the_next(caplog: Any) -> None:
    require("Redis", redis_problem())
    queue = _queue(unique("guard"))
    client = redis.Redis.from_url(REDIS_URL)
    try:
        with Connection(REDIS_URL) as conn:
            channel = conn.channel()
            queue(channel).declare()
            assert guard_channel(channel, POISON_POLICY) is channel
            # Replaced on this channel only, where kombu's poller looks it up (channel.handlers["BRPOP"]).
            assert "_brpop_read" in vars(channel) and channel.handlers["BRPOP"] is channel._brpop_read

            got: list[Any] = []
            consumer = Consumer(channel, [queue], callbacks=[lambda body, message: got.append(message)],
                                accept=["json"])
            consumer.consume()
            # BRPOP takes the oldest first: the poison item, then the good message behind it.
            client.lpush(queue.name, NOT_JSON)
            _publish(conn, queue, {"n": 1})
            _drain_until(conn, got, 1)

            [message] = got
            assert message.decode() == {"n": 1}
            message.ack()
            assert client.lrange(parked_name(queue.name), 0, -1) == [NOT_JSON]
            assert client.llen(queue.name) == 0
            assert "durable.message.parked" in caplog.text
    finally:
        delete_redis_queues(client, [queue.name])
        client.close()


def test_channel_get_guarded_parks_a_poison_row_and_delivers_the_next(sql_url: str, caplog: Any) -> None:
    queue = _queue(unique("guard"))
    with Connection(sql_url) as conn:
        channel = conn.channel()
        queue(channel).declare()
        # A row the transport cannot read, older than the good message.
        session = channel.session
        session.add(channel.message_cls(NOT_JSON, channel._get_or_create(queue.name)))
        session.commit()
        _publish(conn, queue, {"n": 1})

        assert guard_channel(channel, POISON_POLICY) is channel
        assert "_get" in vars(channel)
        got: list[Any] = []
        consumer = Consumer(channel, [queue], callbacks=[lambda body, message: got.append(message)],
                            accept=["json"])
        consumer.consume()
        _drain_until(conn, got, 1)

        [message] = got
        assert message.decode() == {"n": 1}
        message.ack()
        model = channel.message_cls

        def rows(name: str) -> list[Any]:
            return session.query(model).filter(model.queue_id == channel._get_or_create(name).id).all()

        # Delivered rows stay, hidden (kombu < 5.6 counts them in _size too).
        assert [row.visible for row in rows(queue.name)] == [False]
        [row] = rows(parked_name(queue.name))
        assert bytes(row.payload) == NOT_JSON and row.visible is not False, "parked byte for byte, readable"
        assert "durable.message.parked" in caplog.text


@pytest.mark.redis
def test_redis_channel_queue_cycle_is_the_order_brpop_asks_queues_in_and_rotate_moves_one_last() -> None:
    # The guarded _brpop_read rotates the queue it took from to the end, as kombu's own does.
    require("Redis", redis_problem())
    names = [unique("cycle") for _ in range(3)]
    with Connection(REDIS_URL) as conn:
        channel = conn.channel()
        for name in names:
            _queue(name)(channel).declare()
        consumer = Consumer(channel, [_queue(name) for name in names], callbacks=[lambda body, message: None])
        consumer.consume()
        try:
            cycle = channel._queue_cycle
            assert sorted(cycle.consume(3)) == sorted(names)
            names = cycle.consume(3)
            cycle.rotate(names[0])
            assert cycle.consume(3) == [*names[1:], names[0]]
        finally:
            consumer.cancel()
            for name in names:
                channel.queue_delete(name)
