"""The AMQP fetcher against a real RabbitMQ: pipelined gets take what the queue has, in order, and ack."""

from __future__ import annotations

import uuid

import pytest
from kombu import Connection, Exchange, Queue

from celery_durable.worker.fetchers import AmqpFetcher
from tests.e2e.harness import wait_for
from tests.services import AMQP_URL, amqp_problem, require


@pytest.fixture
def amqp_queue():
    require("RabbitMQ", amqp_problem())
    name = f"fetch-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), routing_key=name, auto_delete=False)
    with Connection(AMQP_URL) as conn:
        channel = conn.channel()
        queue(channel).declare()
        yield conn, channel, queue
        conn.default_channel.queue_delete(name)


def publish(conn, queue, *bodies):
    """Publish and return once RabbitMQ holds them all: a publish is not confirmed, and a
    basic.get on another channel can otherwise arrive before the messages are queued."""
    producer = conn.Producer()
    before = depth(conn, queue)
    for body in bodies:
        producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key, serializer="json")
    wait_for(lambda: depth(conn, queue) == before + len(bodies), timeout=10, what="the messages to be queued")


def depth(conn, queue) -> int:
    _, count, _ = conn.default_channel.queue_declare(queue=queue.name, passive=True)
    return int(count)


def test_an_ask_for_more_than_the_queue_holds_takes_all_of_it_in_order(amqp_queue):
    conn, channel, queue = amqp_queue
    publish(conn, queue, "m1", "m2", "m3")
    messages = list(AmqpFetcher(channel, ["json"]).fetch(queue, 5, lambda: True))
    assert [m.decode() for m in messages] == ["m1", "m2", "m3"]
    for message in messages:
        message.ack()
    # The channel is in a clean state: the next ask finds nothing and nothing went missing.
    assert list(AmqpFetcher(channel, ["json"]).fetch(queue, 3, lambda: True)) == []
    assert depth(conn, queue) == 0


def test_an_ask_takes_at_most_its_count_and_leaves_the_rest(amqp_queue):
    conn, channel, queue = amqp_queue
    publish(conn, queue, "a", "b", "c", "d")
    fetched = list(AmqpFetcher(channel, ["json"]).fetch(queue, 2, lambda: True))
    assert [m.decode() for m in fetched] == ["a", "b"]
    assert depth(conn, queue) == 2
    fetched[0].ack()
    fetched[1].reject(requeue=True)
    rest = list(AmqpFetcher(channel, ["json"]).fetch(queue, 4, lambda: True))
    assert sorted(m.decode() for m in rest) == ["b", "c", "d"]
    for message in rest:
        message.ack()
