"""The frame cork against a real RabbitMQ: an ack made in a hub round leaves with the next get, never after the poll."""

from __future__ import annotations

import struct
import threading
import uuid
from collections.abc import Iterator
from socket import SHUT_RDWR
from typing import Any

import pytest
from amqp import spec
from kombu import Connection, Exchange, Queue
from kombu.asynchronous import Hub

from celery_durable.compat.amqp_cork import FrameCork, cork_for
from celery_durable.worker.fetchers import AmqpFetcher
from tests.e2e.harness import wait_for
from tests.services import AMQP_URL, amqp_problem, require

ACK = tuple(spec.Basic.Ack)
GET = tuple(spec.Basic.Get)


class SocketWrites:
    """Every write py-amqp makes on the connection's socket (``transport._write`` is its ``sendall``)."""

    def __init__(self, connection: Any) -> None:
        transport = connection.transport
        self._sendall = transport._write
        self.writes: list[bytes] = []
        transport._write = self._record

    def _record(self, data: Any) -> Any:
        self.writes.append(bytes(data))
        return self._sendall(data)

    def methods(self) -> list[list[tuple[int, int]]]:
        """Each write's method frames, as (class id, method id)."""
        return [methods_in(data) for data in self.writes]


def methods_in(data: bytes) -> list[tuple[int, int]]:
    methods, offset = [], 0
    while offset < len(data):
        frame_type, _, size = struct.unpack_from(">BHI", data, offset)
        if frame_type == 1:
            methods.append(struct.unpack_from(">HH", data, offset + 7))
        offset += 7 + size + 1
    return methods


@pytest.fixture
def rabbit() -> Iterator[tuple[Connection, Any, Queue]]:
    require("RabbitMQ", amqp_problem())
    name = f"cork-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), routing_key=name, auto_delete=False)
    with Connection(AMQP_URL) as conn:
        channel = conn.channel()
        queue(channel).declare()
        producer = conn.Producer()
        for body in ("m1", "m2"):
            producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key, serializer="json")
        wait_for(lambda: depth(conn, queue) == 2, timeout=10, what="the messages to be queued")
        yield conn, channel, queue
        conn.default_channel.queue_delete(name)


def depth(conn: Connection, queue: Queue) -> int:
    _, count, _ = conn.default_channel.queue_declare(queue=queue.name, passive=True)
    return int(count)


def assert_all_acked(conn: Connection, channel: Any, queue: Queue, *, left: tuple[str, ...] = ()) -> None:
    """The acks reached the broker: closing the channel that held the messages puts none back.

    ``left``: the bodies never taken, still in the queue.
    """
    channel.close()
    assert depth(conn, queue) == len(left)
    reader = conn.channel()
    for body in left:
        raw = reader.basic_get(queue.name, no_ack=True)
        assert raw is not None and reader.message_to_python(raw).decode() == body
    assert reader.basic_get(queue.name) is None


def cork(conn: Connection, hub: Hub) -> FrameCork:
    made = cork_for(conn, hub)
    assert made is not None
    return made


def test_an_ack_made_in_a_round_leaves_in_one_write_with_the_next_claims_get(rabbit: Any) -> None:
    conn, channel, queue = rabbit
    hub = Hub()
    frames = cork(conn, hub)
    fetcher = AmqpFetcher(channel, ["json"])
    [first] = fetcher.fetch(queue, 1, lambda: True)
    socket = SocketWrites(conn.connection)

    first.ack()  # the early ack, on the loop thread
    assert socket.writes == []  # held for the connection's next write

    [second] = fetcher.fetch(queue, 1, lambda: True)  # the pass the freed slot kicked
    assert second.decode() == "m2"
    assert socket.methods() == [[ACK, GET]]  # one write: the ack, then the get

    second.ack()
    for tick in list(hub.on_tick):  # the hub's last step before it polls
        tick()
    assert socket.methods() == [[ACK, GET], [ACK]]
    frames.close()
    assert_all_acked(conn, channel, queue)


def test_an_ack_with_no_claim_after_it_is_written_before_the_hub_polls(rabbit: Any) -> None:
    conn, channel, queue = rabbit
    hub = Hub()
    conn.transport.register_with_event_loop(conn.connection, hub)
    frames = cork(conn, hub)
    [message] = AmqpFetcher(channel, ["json"]).fetch(queue, 1, lambda: True)
    socket = SocketWrites(conn.connection)
    written_at_poll: list[list[list[tuple[int, int]]]] = []
    poll = hub.poller.poll

    def recording_poll(timeout: Any) -> Any:
        written_at_poll.append(socket.methods())
        return poll(0)  # the round is what is measured, not a wait

    hub.poller.poll = recording_poll
    hub.call_soon(message.ack)  # Celery's call_soon_ack: no claim follows it in this round
    hub.run_once()

    assert written_at_poll == [[[ACK]]]
    frames.close()
    assert_all_acked(conn, channel, queue, left=("m2",))


def test_another_threads_write_carries_the_held_frames_ahead_of_its_own(rabbit: Any) -> None:
    conn, channel, queue = rabbit
    hub = Hub()
    frames = cork(conn, hub)
    first, second = AmqpFetcher(channel, ["json"]).fetch(queue, 2, lambda: True)
    socket = SocketWrites(conn.connection)

    first.ack()  # held: the loop thread's
    acker = threading.Thread(target=second.ack)  # a pool thread's late ack goes at once
    acker.start()
    acker.join()

    assert socket.methods() == [[ACK, ACK]]
    assert methods_in(socket.writes[0]) == [ACK, ACK]
    assert [struct.unpack_from(">Q", socket.writes[0], 7 + 4 + 21 * i)[0] for i in range(2)] == [
        first.delivery_tag, second.delivery_tag]  # in the order they were made
    frames.close()
    assert_all_acked(conn, channel, queue)


def test_close_sends_what_is_held_and_writes_uncorked_after(rabbit: Any) -> None:
    conn, channel, queue = rabbit
    hub = Hub()
    frames = cork(conn, hub)
    fetcher = AmqpFetcher(channel, ["json"])
    [first] = fetcher.fetch(queue, 1, lambda: True)
    socket = SocketWrites(conn.connection)

    first.ack()
    frames.close()
    assert socket.methods() == [[ACK]]
    assert frames.flush not in hub.on_tick

    [second] = fetcher.fetch(queue, 1, lambda: True)
    second.ack()
    assert socket.methods() == [[ACK], [GET], [ACK]]
    assert_all_acked(conn, channel, queue)


def test_close_on_a_dead_connection_loses_what_was_held_without_raising_and_writes_uncorked(rabbit: Any) -> None:
    """The claimer's stop closes the cork as the consumer tears a lost connection down: its stop must go on."""
    conn, channel, queue = rabbit
    hub = Hub()
    frames = cork(conn, hub)
    plain_writer = frames._plain_writer
    [first] = AmqpFetcher(channel, ["json"]).fetch(queue, 1, lambda: True)
    first.ack()  # held
    amqp_connection = conn.connection  # (kombu's property would open a new one once this one is dead)
    amqp_connection.transport.sock.shutdown(SHUT_RDWR)  # the connection dies under it

    frames.close()  # raised the socket's error out of the claimer's stop before

    assert amqp_connection.frame_writer is plain_writer
    assert "read_frame" not in amqp_connection.transport.__dict__
    assert frames.flush not in hub.on_tick
    with Connection(AMQP_URL) as other:  # the ack died with the connection: the message went back
        wait_for(lambda: depth(other, queue) == 2, timeout=10, what="the unacked message back in the queue")


def test_no_cork_without_a_hub_or_on_another_transport() -> None:
    assert cork_for(Connection("memory://"), Hub()) is None
    require("RabbitMQ", amqp_problem())
    with Connection(AMQP_URL) as conn:
        conn.connect()
        assert cork_for(conn, None) is None
