"""The Redis fetcher against a real Redis: one script call takes messages and records them unacked as kombu does."""

from __future__ import annotations

import json
import uuid

import pytest
import redis
from kombu import Connection, Exchange, Queue

from celery_durable.worker.fetchers import RedisFetcher
from tests.services import REDIS_URL, redis_problem, require


@pytest.fixture
def redis_queue():
    require("Redis", redis_problem())
    name = f"fetch-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), routing_key=name)
    # Unacked records of the test's own: kombu's restore takes the oldest entries of the
    # index it is given, and db 0's shared index also holds other tests' workers' claims.
    own = {"unacked_key": f"{name}.unacked", "unacked_index_key": f"{name}.unacked_index",
           "unacked_mutex_key": f"{name}.unacked_mutex"}
    with Connection(REDIS_URL, transport_options=own) as conn:
        channel = conn.channel()
        queue(channel).declare()
        yield conn, channel, queue
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(name, *[f"{name}\x06\x16{p}" for p in (3, 6, 9)], *own.values())


def publish(conn, queue, *bodies):
    producer = conn.Producer()
    for body in bodies:
        producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key,
                         serializer="json", declare=[queue])


def test_an_ask_takes_at_most_its_count_in_order_and_records_each_unacked(redis_queue):
    conn, channel, queue = redis_queue
    publish(conn, queue, "m1", "m2", "m3")
    fetcher = RedisFetcher(channel, ["json"])
    messages = list(fetcher.fetch(queue, 2, lambda: True))
    assert [m.decode() for m in messages] == ["m1", "m2"]
    client = redis.Redis.from_url(REDIS_URL)
    assert client.llen(queue.name) == 1
    for message in messages:
        stored = json.loads(client.hget(channel.qos.unacked_key, message.delivery_tag))
        # kombu's restore reads exactly this: [payload, exchange, routing_key].
        assert stored == [message._raw, queue.exchange.name, queue.routing_key]
        assert client.zscore(channel.qos.unacked_index_key, message.delivery_tag) is not None


def test_ack_and_reject_work_on_fetched_messages(redis_queue):
    conn, channel, queue = redis_queue
    publish(conn, queue, "acked", "rejected")
    first, second = RedisFetcher(channel, ["json"]).fetch(queue, 5, lambda: True)
    client = redis.Redis.from_url(REDIS_URL)
    first.ack()
    assert client.hget(channel.qos.unacked_key, first.delivery_tag) is None
    second.reject(requeue=True)
    assert client.hget(channel.qos.unacked_key, second.delivery_tag) is None
    assert client.llen(queue.name) == 1
    again = list(RedisFetcher(channel, ["json"]).fetch(queue, 5, lambda: True))
    assert [m.decode() for m in again] == ["rejected"]
    again[0].ack()


def test_an_expired_unacked_message_is_restored_by_kombu_with_redelivered_set(redis_queue):
    conn, channel, queue = redis_queue
    publish(conn, queue, "lost")
    [message] = RedisFetcher(channel, ["json"]).fetch(queue, 1, lambda: True)
    # As if the worker holding it died: its visibility timeout passes.
    channel.qos.visibility_timeout = -1
    channel.qos.restore_visible(num=10, interval=1)
    client = redis.Redis.from_url(REDIS_URL)
    assert client.hget(channel.qos.unacked_key, message.delivery_tag) is None
    [back] = RedisFetcher(channel, ["json"]).fetch(queue, 1, lambda: True)
    assert back.decode() == "lost"
    assert back.delivery_info["redelivered"] is True
    back.ack()


def test_an_empty_queue_yields_nothing_and_writes_nothing(redis_queue):
    conn, channel, queue = redis_queue
    client = redis.Redis.from_url(REDIS_URL)
    before = client.hlen(channel.qos.unacked_key)
    assert list(RedisFetcher(channel, ["json"]).fetch(queue, 3, lambda: True)) == []
    assert client.hlen(channel.qos.unacked_key) == before
