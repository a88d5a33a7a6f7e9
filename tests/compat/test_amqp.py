"""compat.amqp against a real RabbitMQ: py-amqp's method layer pipelines gets and publishes without waiting."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import amqp
import pytest
from amqp import spec
from kombu import Connection

from celery_durable.compat.amqp import pipelined_gets, pipelined_ready_counts, publish_unconfirmed
from tests.compat.conftest import unique
from tests.services import AMQP_URL, amqp_problem, require

pytestmark = pytest.mark.rabbitmq

DEADLINE = 5.0


def _until(condition: Callable[[], Any], what: str, connection: Connection | None = None) -> Any:
    """Poll ``condition`` (serving ``connection``'s incoming frames between looks) until true or the deadline."""
    deadline = time.monotonic() + DEADLINE
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {DEADLINE}s")
        if connection is not None:
            try:
                connection.drain_events(timeout=0.05)
            except TimeoutError:
                pass
        else:
            time.sleep(0.01)


class ReadSpy:
    """Records every read a channel makes: ``wait`` for a method, and the connection's ``drain_events`` timeouts."""

    def __init__(self, channel: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.waited_for: list[Any] = []
        self.drain_timeouts: list[Any] = []
        wait, drain = channel.wait, channel.connection.drain_events

        def spy_wait(method: Any = None, *args: Any, **kwargs: Any) -> Any:
            self.waited_for.append(method)
            return wait(method, *args, **kwargs)

        def spy_drain(timeout: Any = None, **kwargs: Any) -> Any:
            self.drain_timeouts.append(timeout)
            return drain(timeout=timeout, **kwargs)

        monkeypatch.setattr(channel, "wait", spy_wait)
        monkeypatch.setattr(channel.connection, "drain_events", spy_drain)

    def blocking_reads(self) -> list[Any]:
        # py-amqp's publish may poll with timeout=0 (connection.blocked events): that never waits.
        return self.waited_for + [t for t in self.drain_timeouts if t != 0]


def _ready(channel: Any, queue: str) -> int:
    return channel.queue_declare(queue=queue, passive=True).message_count


@pytest.fixture
def amqp_queue() -> Iterator[Callable[..., tuple[Connection, Any, str]]]:
    """``amqp_queue(**connection_options)``: (connection, py-amqp channel, a fresh queue); all removed afterwards."""
    require("RabbitMQ", amqp_problem())
    made: list[tuple[Connection, str]] = []

    def make(**options: Any) -> tuple[Connection, Any, str]:
        conn = Connection(AMQP_URL, **options)
        channel = conn.channel()
        name = unique("amqp")
        channel.queue_declare(queue=name, durable=False, auto_delete=False)
        made.append((conn, name))
        return conn, channel, name

    yield make
    for conn, name in made:
        try:
            conn.channel().queue_delete(name)
        finally:
            conn.close()


def test_channel_send_method_wait_and_on_get_ok_pipeline_gets_in_queue_order(amqp_queue: Any) -> None:
    conn, channel, queue = amqp_queue()
    for body in ("m1", "m2", "m3"):
        channel.basic_publish(amqp.Message(body), exchange="", routing_key=queue)
    _until(lambda: _ready(channel, queue) == 3, "3 messages ready")

    first = pipelined_gets(channel, queue, 2)
    rest = pipelined_gets(channel, queue, 5)  # 1 GetOk, then 4 GetEmpty skipped
    none = pipelined_gets(channel, queue, 3)

    messages = first + rest
    assert [m.body for m in messages] == ["m1", "m2", "m3"]
    assert none == []
    tags = [m.delivery_info["delivery_tag"] for m in messages]
    assert len(set(tags)) == 3
    for m in messages:
        assert m.channel is channel
        assert m.delivery_info["routing_key"] == queue and m.delivery_info["redelivered"] is False
        # kombu takes it as its own message, as AmqpFetcher does.
        assert channel.message_to_python(m).body == m.body
    # The channel is still in step: a plain get after the pipelined ones gets its own reply.
    assert channel.basic_get(queue) is None

    for tag in tags:
        channel.basic_ack(tag)
    channel.close()
    # Acked: nothing comes back when the channel that held them is gone.
    other = conn.channel()
    assert _ready(other, queue) == 0
    assert other.basic_get(queue) is None


def test_channel_queue_declare_passive_pipelined_counts_each_queues_ready_messages(amqp_queue: Any) -> None:
    conn, channel, busy = amqp_queue()
    _, _, empty = amqp_queue()
    _, _, held = amqp_queue()
    for body in ("m1", "m2"):
        channel.basic_publish(amqp.Message(body), exchange="", routing_key=busy)
    channel.basic_publish(amqp.Message("h"), exchange="", routing_key=held)
    _until(lambda: _ready(channel, busy) == 2 and _ready(channel, held) == 1, "3 messages ready")
    [taken] = pipelined_gets(channel, held, 1)  # unacked: not ready any more

    assert pipelined_ready_counts(channel, [busy, empty, held]) == {busy: 2, empty: 0, held: 0}
    # The channel is still in step after the pipelined replies.
    assert [m.body for m in pipelined_gets(channel, busy, 2)] == ["m1", "m2"]
    channel.basic_ack(taken.delivery_info["delivery_tag"])


def test_a_delivery_to_another_channel_read_among_the_probe_replies_reaches_its_consumer(amqp_queue: Any) -> None:
    conn, channel, probed = amqp_queue()
    other_conn, other_channel, consumed = amqp_queue()
    delivered: list[Any] = []
    other_channel.basic_publish(amqp.Message("ready"), exchange="", routing_key=probed)
    _until(lambda: _ready(other_channel, probed) == 1, "1 message ready")
    consumer_channel = conn.channel()
    consumer_channel.basic_consume(consumed, callback=delivered.append)
    other_channel.basic_publish(amqp.Message("for the consumer"), exchange="", routing_key=consumed)
    # Sent to the consumer: its frames wait unread on the probing connection's
    # socket (nothing on that connection reads until the probe does).
    _until(lambda: _ready(other_channel, consumed) == 0, "the message sent to the consumer")
    assert delivered == []

    assert pipelined_ready_counts(channel, [probed, consumed]) == {probed: 1, consumed: 0}
    # The probe read the delivery's frames first and handed them to py-amqp.
    assert [m.body for m in delivered] == ["for the consumer"]
    consumer_channel.basic_ack(delivered[0].delivery_tag)


def test_a_probe_of_a_queue_that_is_gone_raises_not_found(amqp_queue: Any) -> None:
    conn, channel, queue = amqp_queue()
    with pytest.raises(amqp.exceptions.NotFound):
        pipelined_ready_counts(channel, [queue, unique("gone")])


def test_channel_basic_publish_waits_for_the_ack_in_confirm_publish_mode(amqp_queue: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    conn, channel, queue = amqp_queue(transport_options={"confirm_publish": True})
    acks: list[tuple[int, bool]] = []
    channel.events["basic_ack"].add(lambda tag, multiple: acks.append((tag, multiple)))
    reads = ReadSpy(channel, monkeypatch)
    channel.basic_publish(amqp.Message("waited"), exchange="", routing_key=queue)
    # Why compat publishes a batch through _basic_publish: this one waits for each message's ack.
    assert [spec.Basic.Ack, spec.Basic.Nack] in reads.waited_for
    assert acks == [(1, False)]


def test_channel__basic_publish_does_not_wait_for_the_ack_on_a_confirm_channel(
        amqp_queue: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    conn, channel, queue = amqp_queue(transport_options={"confirm_publish": True})
    channel.confirm_select()
    acked: set[int] = set()

    def on_ack(tag: int, multiple: bool) -> None:
        acked.update(range(1, tag + 1) if multiple else [tag])

    channel.events["basic_ack"].add(on_ack)
    reads = ReadSpy(channel, monkeypatch)
    for body in ("b1", "b2", "b3"):
        publish_unconfirmed(channel, amqp.Message(body), exchange="", routing_key=queue)
    assert reads.blocking_reads() == [], "publish_unconfirmed must not wait for the broker"

    _until(lambda: acked >= {1, 2, 3}, "acks of the batch", connection=conn)
    bodies = [channel.basic_get(queue, no_ack=True).body for _ in range(3)]
    assert bodies == ["b1", "b2", "b3"]
