"""compat.redis_acks against a real Redis: kombu's ack split in two writes what kombu's own ack writes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue

from celery_durable.compat import redis_acks
from tests.compat.conftest import delete_redis_queues, unique
from tests.services import REDIS_URL, redis_problem, require

pytestmark = pytest.mark.redis


class Acking:
    def __init__(self, conn: Connection, channel: Any, queue: Queue, own: dict[str, str]) -> None:
        self.conn, self.channel, self.queue, self.own = conn, channel, queue, own
        self.client = redis.Redis.from_url(REDIS_URL)

    def take(self, count: int) -> list[Any]:
        producer = self.conn.Producer()
        for i in range(count):
            producer.publish({"n": i}, exchange=self.queue.exchange, routing_key=self.queue.routing_key,
                             serializer="json", declare=[self.queue])
        bound = self.queue(self.channel)
        return [bound.get(no_ack=False) for _ in range(count)]

    def records(self) -> tuple[set[bytes], set[bytes]]:
        return (set(self.client.hkeys(self.own["unacked_key"])),
                set(self.client.zrange(self.own["unacked_index_key"], 0, -1)))


@pytest.fixture
def acking() -> Iterator[Acking]:
    require("Redis", redis_problem())
    name = unique("acks")
    own = {"unacked_key": f"{name}.unacked", "unacked_index_key": f"{name}.unacked_index",
           "unacked_mutex_key": f"{name}.unacked_mutex"}
    with Connection(REDIS_URL, transport_options=own) as conn:
        channel = conn.channel()
        queue = Queue(name, Exchange(name), routing_key=name)
        queue(channel).declare()
        yield Acking(conn, channel, queue, own)
    client = redis.Redis.from_url(REDIS_URL)
    delete_redis_queues(client, [name])
    client.delete(*own.values(), f"{name}.held")


def test_kombus_ack_removes_exactly_the_records_send_acks_removes(acking):
    """``send_acks`` mirrors kombu's ``QoS.ack``: the unacked hash and index entries of the tag, nothing else."""
    by_kombu, by_us = acking.take(2)
    before = acking.records()
    assert before[0] == before[1] == {by_kombu.delivery_tag.encode(), by_us.delivery_tag.encode()}
    by_kombu.ack()
    assert acking.records() == ({by_us.delivery_tag.encode()},) * 2
    with acking.channel.conn_or_acquire() as client:
        redis_acks.send_acks(acking.channel, client, [by_us.delivery_tag], None)
    assert acking.records() == (set(), set())


def test_a_deferred_ack_settles_the_message_in_memory_and_leaves_the_redis_records(acking):
    deferred: list[Any] = []
    redis_acks.defer_acks(acking.channel, lambda tag: deferred.append(tag) or True)
    first, second = acking.take(2)
    first.ack()  # Message.ack goes through channel.basic_ack
    assert deferred == [first.delivery_tag]
    assert first.acknowledged
    assert first.delivery_tag.encode() in acking.records()[0]
    # The channel's in-memory record no longer holds it: a closing channel restores only the other one.
    acking.channel.close()
    assert acking.client.llen(acking.queue.name) == 1


def test_a_reject_is_never_deferred(acking):
    deferred: list[Any] = []
    redis_acks.defer_acks(acking.channel, lambda tag: deferred.append(tag) or True)
    (message,) = acking.take(1)
    message.reject(requeue=True)
    assert deferred == []
    assert acking.records() == (set(), set())
    assert acking.client.llen(acking.queue.name) == 1


def test_an_ack_not_deferred_is_kombus_own(acking):
    redis_acks.defer_acks(acking.channel, lambda tag: False)
    (message,) = acking.take(1)
    message.ack()
    assert message.acknowledged
    assert acking.records() == (set(), set())
