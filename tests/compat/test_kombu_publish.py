"""compat.kombu_publish against a real Redis: kombu's publish seams hand over what it would have written."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue
from kombu.messaging import Producer
from kombu.utils.json import dumps

from celery_durable.compat.kombu_publish import (
    producer_batch_seam_free,
    producer_publishes_to,
    record_redis_put,
    redis_batch_supported,
)
from celery_durable.compat.redis_claim import priority_lists
from tests.compat.conftest import delete_redis_queues, unique
from tests.services import REDIS_URL, redis_problem, require

pytestmark = pytest.mark.redis

#: kombu 5.7 added Producer.batch() and its per-producer seam; before it compat publishes one message at a time.
PRODUCER_BATCH = hasattr(Producer, "batch")


class Sink:
    def __init__(self) -> None:
        self.published: list[tuple[Any, Any, dict[str, Any]]] = []

    def publish(self, channel: Any, message: Any, **publish_kwargs: Any) -> None:
        self.published.append((channel, message, publish_kwargs))


class Commands:
    def __init__(self) -> None:
        self.commands: list[tuple[str, tuple[Any, ...]]] = []

    def add(self, name: str, *args: Any) -> None:
        self.commands.append((name, args))


@pytest.fixture
def redis_env() -> Iterator[tuple[Connection, Queue, redis.Redis]]:
    require("Redis", redis_problem())
    name = unique("publish")
    queue = Queue(name, Exchange(name), routing_key=name)
    client = redis.Redis.from_url(REDIS_URL)
    with Connection(REDIS_URL) as conn:
        queue(conn.default_channel).declare()
        yield conn, queue, client
    delete_redis_queues(client, [name])
    client.close()


def _queued(client: redis.Redis, channel: Any, queue: str) -> int:
    return sum(client.llen(name) for name in priority_lists(channel, queue))


def test_producer_batch_local_is_detected_as_this_kombu_has_it(redis_env: Any) -> None:
    conn, _, _ = redis_env
    producer = conn.Producer()
    assert producer_batch_seam_free(producer) is PRODUCER_BATCH
    if PRODUCER_BATCH:
        with producer.batch():
            assert not producer_batch_seam_free(producer), "an open Producer.batch() holds the seam"
        assert producer_batch_seam_free(producer)


@pytest.mark.skipif(not PRODUCER_BATCH, reason="kombu < 5.7 has no Producer._batch_local: compat publishes "
                                              "one message at a time there (producer_batch_seam_free is False)")
def test_producer_batch_local_current_diverts_publish_to_the_sink(redis_env: Any) -> None:
    conn, queue, client = redis_env
    producer = conn.Producer()
    sink = Sink()
    assert producer_batch_seam_free(producer)
    with producer_publishes_to(producer, sink):
        assert not producer_batch_seam_free(producer)
        producer.publish({"n": 1}, exchange=queue.exchange, routing_key=queue.routing_key, serializer="json",
                         declare=[queue], priority=6, headers={"h": "v"})
    assert producer_batch_seam_free(producer), "the seam is free again once the block ends"
    assert _queued(client, producer.channel, queue.name) == 0, "nothing may reach the broker"

    [(channel, message, kwargs)] = sink.published
    assert channel is producer.channel
    # The channel's prepare_message result, before the channel's basic_publish.
    assert message["content-type"] == "application/json"
    assert message["headers"] == {"h": "v"}
    assert message["properties"]["priority"] == 6
    assert kwargs == {"exchange": queue.exchange.name, "routing_key": queue.routing_key, "mandatory": False,
                      "immediate": False, "timeout": None, "confirm_timeout": None}

    # Handed to basic_publish as kombu would have, it is the message a plain publish stores.
    channel.basic_publish(message, **kwargs)
    got = channel.basic_get(queue.name, no_ack=True)
    assert channel.message_to_python(got).decode() == {"n": 1}


def test_channel_put_with_publish_batch_records_the_lpush_kombu_would_run(redis_env: Any) -> None:
    conn, queue, client = redis_env
    channel = conn.default_channel
    if not redis_batch_supported(channel):
        pytest.skip("this kombu's Redis channel has no publish-batch hook (kombu < 5.7): compat does not use it")
    producer = conn.Producer()
    # Where kombu's own publish puts a message of priority 6.
    producer.publish("plain", exchange=queue.exchange, routing_key=queue.routing_key, priority=6)
    [target] = [name for name in priority_lists(channel, queue.name) if client.llen(name)]
    client.delete(target)

    message = channel.prepare_message(dumps({"n": 2}), 6, "application/json", "utf-8", {}, {})
    sink = Commands()
    record_redis_put(channel, message, queue.exchange.name, queue.routing_key, [queue.name], sink)

    assert sink.commands == [("lpush", (target, dumps(message)))]
    props = message["properties"]
    assert props["delivery_tag"] and props["body_encoding"] == "base64"
    assert props["delivery_info"] == {"exchange": queue.exchange.name, "routing_key": queue.routing_key}
    assert _queued(client, channel, queue.name) == 0, "recording runs nothing"

    # Run as recorded, kombu reads it back as the message.
    for name, args in sink.commands:
        getattr(client, name)(*args)
    got = channel.message_to_python(channel.basic_get(queue.name, no_ack=True))
    assert got.decode() == {"n": 2}
    assert got.delivery_tag == props["delivery_tag"]
