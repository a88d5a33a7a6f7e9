"""Batch publishing of outbox rows on the real brokers: what the fast paths store, when they step aside, confirms."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from kombu import Connection, Exchange, Queue

from celery_durable import outbox
from celery_durable.headers import SENT_AT_HEADER
from celery_durable.outbox.publishing import amqp_confirms, redis_pipeline
from celery_durable.outbox.publishing.batch import publish_batch, publish_one_by_one
from celery_durable.outbox.publishing.outcome import BatchPublished
from celery_durable.outbox.relay import Relay
from celery_durable.store import outbox as store
from celery_durable.store.outbox import OutboxRow
from celery_durable.testing.clock import FakeClock
from celery_durable.worker.signals import connect_install
from tests.conftest import MESSAGE_BROKERS
from tests.e2e.harness import wait_for
from tests.faultproxy import FaultProxy
from tests.services import broker_url
from tests.task_events import listening

SEP = "\x06\x16"
#: One clock for both publishes of a row.
FIXED_NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)


#: Stands still: both publishes of a row read the same now.
FIXED = FakeClock(now=FIXED_NOW)


def make_app(broker: str, store_url: str) -> Celery:
    app = Celery(f"publish-{uuid.uuid4().hex[:6]}", broker=broker)
    app.conf.durable_database_url = store_url
    app.conf.broker_connection_retry_on_startup = True

    @app.task(name="publish.noop", shared=False)
    def noop(label: str, n: int = 0) -> str:  # pragma: no cover - never run here: the tests read the broker
        return label

    return app



def enqueue_and_claim(app: Celery, engine: sa.engine.Engine, specs: list[tuple[tuple[Any, ...], dict[str, Any]]]
                      ) -> list[OutboxRow]:
    """Commit one outbox row per (args, options); return them as the relay would claim them."""
    noop = app.tasks["publish.noop"]
    with engine.begin() as conn:
        for args, options in specs:
            outbox.enqueue(conn, noop.s(*args), **options)
    with engine.connect() as conn, conn.begin():
        # Claimed in a transaction rolled back at once: the rows stay for the relay-level tests.
        return store.claim(conn, len(specs) + 10, datetime.now(timezone.utc) + timedelta(days=1))


def stored_messages(client: redis.Redis, queue: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every message kombu stored for ``queue`` (all priority lists), by task id: (list key, raw JSON decoded)."""
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for key in [queue] + [f"{queue}{SEP}{p}" for p in (3, 6, 9)]:
        while (raw := client.rpop(key)) is not None:
            message = json.loads(raw)
            found[message["headers"]["id"]] = (key, message)
    return found


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(broker_url("redis"))
    yield client
    client.close()


def test_redis_fast_path_stores_each_message_as_kombu_would(
        store_url: str, user_engine: sa.engine.Engine, redis_client: redis.Redis) -> None:
    app = make_app(broker_url("redis"), store_url)
    queue = f"same-{uuid.uuid4().hex[:8]}"
    specs: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (("plain",), {"queue": queue}),
        (("urgent", 1), {"queue": queue, "priority": 7}),
        (("low",), {"queue": queue, "priority": 2}),
        (("top",), {"queue": queue, "priority": 9}),
        (("timed",), {"queue": queue, "countdown": 30, "expires": FIXED_NOW + timedelta(minutes=5),
                      "headers": {"tenant": "t1"}, "time_limit": 20, "soft_time_limit": 10,
                      "shadow": "publish.alias"}),
    ]
    rows = enqueue_and_claim(app, user_engine, specs)
    connect_install()  # as install(app) does: both paths stamp each message's send time
    sent_from = time.time()
    with app.producer_or_acquire() as producer:
        assert redis_pipeline.handles(producer.connection.transport, producer)
        per_message = publish_one_by_one(app, producer, rows, FIXED)
    by_kombu = stored_messages(redis_client, queue)
    with app.producer_or_acquire() as producer:
        batched = publish_batch(app, producer, rows, FIXED)
    by_batch = stored_messages(redis_client, queue)
    sent_until = time.time()

    assert per_message == BatchPublished(sent=5, one_by_one=5)
    assert batched == BatchPublished(sent=5, batched=5)
    assert set(by_kombu) == set(by_batch) == {row.task_id for row in rows}
    for task_id, (key, message) in by_batch.items():
        kombu_key, kombu_message = by_kombu[task_id]
        # The delivery tag is a fresh uuid per publish, in both paths.
        tag, kombu_tag = message["properties"].pop("delivery_tag"), kombu_message["properties"].pop("delivery_tag")
        assert tag != kombu_tag and uuid.UUID(tag) and uuid.UUID(kombu_tag)
        # The send time is each publish's own, in both paths.
        for stored in (message, kombu_message):
            assert sent_from <= stored["headers"].pop(SENT_AT_HEADER) <= sent_until
        assert (key, message) == (kombu_key, kombu_message)
    keys = {by_batch[row.task_id][0] for row in rows}
    # kombu's priority lists: 0 -> the queue itself, 2 -> 0 too, 7 -> 6, 9 -> 9.
    assert keys == {queue, f"{queue}{SEP}6", f"{queue}{SEP}9"}
    timed = by_batch[rows[4].task_id][1]
    assert timed["headers"]["tenant"] == "t1" and timed["headers"]["shadow"] == "publish.alias"
    # The expiry travels in the header alone: no RabbitMQ TTL to drop the message before a worker sees it.
    assert timed["headers"]["expires"] == (FIXED_NOW + timedelta(minutes=5)).isoformat()
    assert "expiration" not in timed["properties"]
    assert timed["properties"]["delivery_info"] == {"exchange": "", "routing_key": queue}


def test_a_declared_direct_exchange_is_batched_through_its_binding_table(
        store_url: str, user_engine: sa.engine.Engine, redis_client: redis.Redis) -> None:
    app = make_app(broker_url("redis"), store_url)
    suffix = uuid.uuid4().hex[:8]
    bound = Queue(f"bound-{suffix}", Exchange(f"dx-{suffix}", type="direct"), routing_key="orders")
    app.conf.task_queues = [bound]
    rows = enqueue_and_claim(app, user_engine, [
        (("a",), {"queue": bound.name, "exchange": bound.exchange.name, "routing_key": "orders"}),
        (("b",), {"queue": bound.name, "exchange": bound.exchange.name, "routing_key": "orders"}),
    ])
    with app.producer_or_acquire() as producer:
        result = publish_batch(app, producer, rows, FIXED)
    assert result == BatchPublished(sent=2, batched=2)
    stored = stored_messages(redis_client, bound.name)
    assert set(stored) == {row.task_id for row in rows}
    assert all(m["properties"]["delivery_info"] == {"exchange": bound.exchange.name, "routing_key": "orders"}
               for _, m in stored.values())
    redis_client.delete(f"_kombu.binding.{bound.exchange.name}", f"_kombu.binding_permanent.{bound.exchange.name}")


def test_routes_the_fast_path_cannot_reproduce_take_kombus_own_publish_in_order(
        store_url: str, user_engine: sa.engine.Engine, redis_client: redis.Redis) -> None:
    app = make_app(broker_url("redis"), store_url)
    suffix = uuid.uuid4().hex[:8]
    plain = f"plain-{suffix}"
    topic = Queue(f"topic-{suffix}", Exchange(f"tx-{suffix}", type="topic"), routing_key="orders.#")
    # Bound by some other process: the relay's connection never declared this
    # exchange, so kombu would assume "direct"; the fast path must not assume.
    foreign_exchange, foreign_queue = f"foreign-x-{suffix}", f"foreign-{suffix}"
    redis_client.sadd(f"_kombu.binding.{foreign_exchange}", SEP.join(["eu", "", foreign_queue]))
    app.conf.task_queues = [topic]
    app.conf.task_create_missing_queues = True
    rows = enqueue_and_claim(app, user_engine, [
        (("first",), {"queue": plain}),
        (("by-topic",), {"queue": topic.name}),
        (("second",), {"queue": plain}),
        (("foreign",), {"exchange": foreign_exchange, "routing_key": "eu"}),
        (("third",), {"queue": plain}),
    ])
    try:
        with app.producer_or_acquire() as producer:
            result = publish_batch(app, producer, rows, FIXED)
        assert result == BatchPublished(sent=5, batched=3, one_by_one=2)
        assert list(stored_messages(redis_client, topic.name)) == [rows[1].task_id]
        assert list(stored_messages(redis_client, foreign_queue)) == [rows[3].task_id]
        # Publishing resumed in id order around them: LPUSH order is publish order.
        assert [json.loads(raw)["headers"]["id"] for raw in redis_client.lrange(plain, 0, -1)][::-1] == \
            [rows[0].task_id, rows[2].task_id, rows[4].task_id]
    finally:
        redis_client.delete(plain, f"_kombu.binding.{foreign_exchange}", f"_kombu.binding.{topic.exchange.name}",
                            f"_kombu.binding_permanent.{topic.exchange.name}")


# The batch publishes differently per transport (a Redis pipeline, AMQP confirms): each is proven.
@pytest.mark.parametrize("broker", MESSAGE_BROKERS, indirect=True)
def test_relay_passes_use_the_batch_and_mark_rows(store_url: str, user_engine: sa.engine.Engine,
                                                  broker: tuple[str, str]) -> None:
    app = make_app(broker[1], store_url)
    queue = f"relay-{uuid.uuid4().hex[:8]}"
    noop = app.tasks["publish.noop"]
    with user_engine.begin() as conn:
        ids = [outbox.enqueue(conn, noop.s(str(i)), queue=queue, priority=i % 10).id for i in range(120)]
    relay = Relay(app, batch_size=50)
    results = [relay.run_pass() for _ in range(4)]
    assert [(r.claimed, r.published, r.batched, r.one_by_one) for r in results] == \
        [(50, 50, 50, 0), (50, 50, 50, 0), (20, 20, 20, 0), (0, 0, 0, 0)]
    with Connection(app.conf.broker_url) as conn:
        simple = conn.SimpleQueue(queue, no_ack=True)
        got = []
        try:
            while len(got) < len(ids):
                got.append(simple.get(block=True, timeout=5).headers["id"])
        finally:
            simple.close()
    assert sorted(got) == sorted(ids)


@pytest.fixture
def amqp_app(store_url: str) -> Iterator[Celery]:
    app = make_app(broker_url("rabbitmq"), store_url)
    yield app
    app.close()


def drain_ids(app: Celery, queue: str, count: int) -> list[str]:
    """``count`` task ids from ``queue`` on any broker (each within 5 s)."""
    with Connection(app.conf.broker_url) as conn:
        simple = conn.SimpleQueue(queue, no_ack=True)
        try:
            return [simple.get(block=True, timeout=5).headers["id"] for _ in range(count)]
        finally:
            simple.close()


def drain_amqp(app: Celery, queue: str, count: int, *, quiet_for: float | None = None) -> list[str]:
    """``count`` task ids from ``queue`` (each within 5 s); then, with ``quiet_for``, any more that come."""
    with Connection(app.conf.broker_url) as conn:
        simple = conn.SimpleQueue(queue, no_ack=True)
        try:
            ids = [simple.get(block=True, timeout=5).headers["id"] for _ in range(count)]
            while quiet_for is not None:
                try:
                    ids.append(simple.get(block=True, timeout=quiet_for).headers["id"])
                except simple.Empty:
                    break
            return ids
        finally:
            simple.close()


def test_rabbitmq_batch_is_published_under_confirms_in_order(
        amqp_app: Celery, user_engine: sa.engine.Engine) -> None:
    queue = f"confirm-{uuid.uuid4().hex[:8]}"
    rows = enqueue_and_claim(amqp_app, user_engine, [((str(i),), {"queue": queue}) for i in range(200)])
    with amqp_app.producer_or_acquire() as producer:
        assert amqp_confirms.handles(producer.connection.transport, producer)
        result = publish_batch(amqp_app, producer, rows, FIXED)
    assert result == BatchPublished(sent=200, batched=200)
    assert drain_amqp(amqp_app, queue, 200) == [row.task_id for row in rows]


def test_rabbitmq_refusal_or_missing_acks_fail_the_whole_batch_and_the_next_one_goes_through(
        amqp_app: Celery, user_engine: sa.engine.Engine) -> None:
    queue = f"refused-{uuid.uuid4().hex[:8]}"
    rows = enqueue_and_claim(amqp_app, user_engine, [
        (("ok-1",), {"queue": queue}),
        # An exchange that does not exist: RabbitMQ closes the channel (404) instead of acking.
        (("lost",), {"exchange": f"no-such-exchange-{uuid.uuid4().hex[:6]}", "routing_key": "x"}),
        (("ok-2",), {"queue": queue}),
    ])
    with amqp_app.producer_or_acquire() as producer:
        refused = publish_batch(amqp_app, producer, rows, FIXED)
    assert refused.sent == 0 and refused.error is not None and "NOT_FOUND" in str(refused.error).upper()

    # No time at all for the acks: the batch counts as failed (its messages may have gone out).
    good = [rows[0], rows[2]]
    with amqp_app.producer_or_acquire() as producer:
        timed_out = amqp_confirms.publish(amqp_app, producer, good, FIXED, timeout=0.0)
    assert timed_out.sent == 0 and isinstance(timed_out.error, amqp_confirms.ConfirmTimeout)

    # The pool's connection was replaced after the timeout; the retry goes through.
    with amqp_app.producer_or_acquire() as producer:
        retried = publish_batch(amqp_app, producer, good, FIXED)
    assert retried == BatchPublished(sent=2, batched=2)
    # The retry delivered both. Before it, ok-1 may have gone out ahead of the refusal, and
    # either may have gone out in the timed-out batch (frames written, acks not awaited: the
    # broker may or may not have routed them before the connection was dropped). Whatever
    # went out twice went out under the same task id, which is what makes a durable task's
    # second delivery a no-op; nothing else went out.
    delivered = drain_amqp(amqp_app, queue, 2, quiet_for=1.0)
    counts = Counter(delivered)
    assert set(counts) == {rows[0].task_id, rows[2].task_id}
    assert counts[rows[0].task_id] <= 3 and counts[rows[2].task_id] <= 2


# Each transport's client fails a dead pooled connection its own way (redis-py, py-amqp): each is proven.
@pytest.mark.parametrize("broker", MESSAGE_BROKERS, indirect=True)
def test_a_relay_pass_rides_over_a_pooled_connection_the_broker_dropped(
        store_url: str, user_engine: sa.engine.Engine, broker: tuple[str, str],
        fault_proxy: Callable[[str], FaultProxy]) -> None:
    # Only this test's connections go through the proxy, so only they are cut. They are reset
    # (RST), as a broker restart leaves them: a pooled connection's next write fails with an
    # OSError. A broker closing them politely would leave them readable for a while, and
    # kombu recovers from that on its own.
    proxy = fault_proxy(broker[1])
    app = make_app(proxy.url_for(broker[1]), store_url)
    queue = f"dropped-{uuid.uuid4().hex[:8]}"
    noop = app.tasks["publish.noop"]
    relay = Relay(app)
    with user_engine.begin() as conn:
        before = outbox.enqueue(conn, noop.s("before"), queue=queue).id
    assert relay.run_pass().published == 1  # the producer pool now holds a connection
    proxy.drop_connections()
    accepted = proxy.accepted
    with user_engine.begin() as conn:
        after = outbox.enqueue(conn, noop.s("after"), queue=queue).id
    result = relay.run_pass()
    assert proxy.accepted > accepted, "the pass reconnected: the pooled connection was the dropped one"
    # One pass, as kombu's own publish would manage: not a failure waiting out the relay's backoff.
    assert (result.claimed, result.published, result.error) == (1, 1, None)
    with Connection(app.conf.broker_url) as conn:
        simple = conn.SimpleQueue(queue, no_ack=True)
        try:
            got = [simple.get(block=True, timeout=5).headers["id"] for _ in range(2)]
        finally:
            simple.close()
    assert sorted(got) == sorted([before, after])


# The batch publishes differently per transport (a Redis pipeline, AMQP confirms): each is proven.
@pytest.mark.parametrize("broker", MESSAGE_BROKERS, indirect=True)
@pytest.mark.parametrize("path", ["batch", "one-by-one"])
def test_each_published_row_emits_one_task_sent_event_after_its_message(
        store_url: str, user_engine: sa.engine.Engine, broker: tuple[str, str], path: str) -> None:
    """``task_send_sent_event`` (Flower setups turn it on): Celery's send path publishes the event
    through the same producer, which a captured batch read as a second message and refused."""
    app = make_app(broker[1], store_url)
    app.conf.task_send_sent_event = True
    queue = f"sent-{uuid.uuid4().hex[:8]}"
    rows = enqueue_and_claim(app, user_engine, [((str(i),), {"queue": queue}) for i in range(5)])
    with listening(broker[1]) as events, app.producer_or_acquire() as producer:
        publish = publish_batch if path == "batch" else publish_one_by_one
        result = publish(app, producer, rows, FIXED)
        assert result.sent == 5 and result.error is None, result
        assert (result.batched, result.one_by_one) == ((5, 0) if path == "batch" else (0, 5))
        wait_for(lambda: all(events.task_sent(row.task_id) for row in rows), timeout=10,
                 what="a task-sent event for every published row")
    for row in rows:
        (event,) = events.task_sent(row.task_id)
        assert (event["name"], event["queue"], event["args"]) == ("publish.noop", queue,
                                                                  repr(json.loads(row.args)))
    assert sorted(drain_ids(app, queue, 5)) == sorted(row.task_id for row in rows)


def test_a_refused_batch_emits_no_task_sent_event_and_its_retry_emits_each_once(
        amqp_app: Celery, user_engine: sa.engine.Engine) -> None:
    amqp_app.conf.task_send_sent_event = True
    queue = f"sent-refused-{uuid.uuid4().hex[:8]}"
    rows = enqueue_and_claim(amqp_app, user_engine, [
        (("ok-1",), {"queue": queue}),
        (("lost",), {"exchange": f"no-such-exchange-{uuid.uuid4().hex[:6]}", "routing_key": "x"}),
        (("ok-2",), {"queue": queue}),
    ])
    good = [rows[0], rows[2]]
    with listening(amqp_app.conf.broker_url) as events:
        with amqp_app.producer_or_acquire() as producer:
            refused = publish_batch(amqp_app, producer, rows, FIXED)
        assert refused.sent == 0 and refused.error is not None
        with amqp_app.producer_or_acquire() as producer:
            retried = publish_batch(amqp_app, producer, good, FIXED)
        assert retried == BatchPublished(sent=2, batched=2)
        wait_for(lambda: all(events.task_sent(row.task_id) for row in good), timeout=10,
                 what="the retried rows' task-sent events")
        # Heard after the retry's: had the refused batch emitted any, they would have come first.
        assert [len(events.task_sent(row.task_id)) for row in rows] == [1, 0, 1]
    drain_amqp(amqp_app, queue, 2, quiet_for=0.5)
