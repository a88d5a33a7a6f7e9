"""compat.queue_probe against real brokers: a queue's ready messages and its next messages' headers, nothing taken."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue

from celery_durable.compat.queue_probe import probe
from tests.compat.conftest import delete_redis_queues, unique
from tests.services import AMQP_URL, REDIS_URL, amqp_problem, redis_problem, require


def _broker(kind: str) -> str:
    if kind == "redis":
        require("Redis", redis_problem())
        return REDIS_URL
    require("RabbitMQ", amqp_problem())
    return AMQP_URL


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_queue(request: Any) -> Iterator[tuple[Connection, Any, Queue]]:
    conn = Connection(_broker(request.param))
    channel = conn.channel()
    name = unique("probe")
    queue = Queue(name, Exchange(name), routing_key=name, max_priority=9)
    queue(channel).declare()
    yield conn, channel, queue
    if request.param == "redis":
        with channel.conn_or_acquire() as client:
            delete_redis_queues(client, [name])
    else:
        conn.channel().queue_delete(name)
    conn.close()


def _publish(conn: Connection, queue: Queue, label: str, priority: int | None = None) -> None:
    conn.Producer().publish({"label": label}, exchange=queue.exchange, routing_key=queue.routing_key,
                            headers={"label": label}, serializer="json", priority=priority)


def _probe_until(channel: Any, queue: Queue, depth: int) -> Any:
    """Probe until the broker has routed what was published (RabbitMQ: another channel's publish arrives
    in its own time); fail after 5 s naming the last reading."""
    deadline = time.monotonic() + 5.0
    while True:
        probed = probe(channel, queue)
        if probed is not None and probed.depth == depth:
            return probed
        assert time.monotonic() < deadline, f"depth never reached {depth}: last {probed}"
        time.sleep(0.01)


def _drain(channel: Any, queue: Queue) -> list[str]:
    labels = []
    while (message := channel.basic_get(queue.name, no_ack=True)) is not None:
        labels.append(channel.message_to_python(message).headers["label"]
                      if hasattr(channel, "message_to_python") else message.headers["label"])
    return labels


def test_an_empty_queue_has_depth_0_and_no_head(broker_queue):
    _, channel, queue = broker_queue
    probed = probe(channel, queue)
    assert probed is not None and probed.depth == 0 and probed.heads == ()


def test_depth_counts_ready_messages_and_the_head_is_the_next_to_go_left_in_place(broker_queue):
    conn, channel, queue = broker_queue
    for label in ("m1", "m2", "m3"):
        _publish(conn, queue, label)
    probed = _probe_until(channel, queue, 3)
    assert [head["label"] for head in probed.heads] == ["m1"]
    again = probe(channel, queue)
    assert again is not None and again.depth == 3, "the probe took nothing"
    assert _drain(channel, queue) == ["m1", "m2", "m3"], "every message is still there, in its order"


def test_a_queue_the_broker_does_not_have_reads_as_none_on_rabbitmq_and_empty_on_redis(broker_queue):
    conn, _, _ = broker_queue
    missing = Queue(unique("missing"), Exchange("missing"), routing_key="missing")
    probed = probe(conn.channel(), missing)
    if conn.transport.driver_type == "amqp":
        assert probed is None
    else:  # a Redis queue is its lists, and a list with nothing in it does not exist
        assert probed is not None and probed.depth == 0


def test_the_heads_are_what_goes_next_of_each_priority(broker_queue):
    conn, channel, queue = broker_queue
    _publish(conn, queue, "low", priority=0)
    _publish(conn, queue, "high", priority=9)
    probed = _probe_until(channel, queue, 2)
    heads = sorted(head["label"] for head in probed.heads)
    if conn.transport.driver_type == "redis":
        assert heads == ["high", "low"]  # one list per priority: each one's next message
    else:
        assert heads == ["high"]  # a priority queue delivers the highest first: that is its head
