"""The queue watch against a real RabbitMQ: the placeholder's credit lets exactly what a give allows through."""

from __future__ import annotations

import uuid

import pytest
from kombu import Connection, Exchange, Queue

from celery_durable.testing.clock import FakeClock
from celery_durable.worker.queue_watch import QueueWatch
from tests.e2e.harness import wait_for
from tests.services import AMQP_URL, amqp_problem, require


class Watched:
    """A watch on real queues, its deliveries recorded; the test reads the connection as the hub would."""

    def __init__(self, conn: Connection, names: list[str]) -> None:
        self.conn = conn
        self.names = names
        self.clock = FakeClock()
        self.deliveries: list[tuple[str, object]] = []
        self.watch = QueueWatch(conn.connection, ["json"], lambda q, m: self.deliveries.append((q, m)), self.clock)

    def read(self, until, what: str) -> None:
        def step() -> bool:
            try:
                self.conn.drain_events(timeout=0.02)
            except TimeoutError:
                pass
            return bool(until())
        wait_for(step, timeout=10, what=what)

    def read_for(self, rounds: int) -> None:
        """Read whatever the broker sends for a while (a check that nothing more comes)."""
        for _ in range(rounds):
            try:
                self.conn.drain_events(timeout=0.02)
            except TimeoutError:
                pass

    def depth(self, name: str) -> int:
        _, count, _ = self.conn.default_channel.queue_declare(queue=name, passive=True)
        return int(count)

    def publish(self, name: str, body: str) -> None:
        before = self.depth(name)
        self.conn.Producer().publish(body, exchange=name, routing_key=name, serializer="json")
        wait_for(lambda: self.depth(name) == before + 1, timeout=10, what="the message to be queued")

    def give(self) -> None:
        self.clock.advance(1.0)  # past the 5 ms gate: the test says when
        assert self.watch.give()


@pytest.fixture
def watched():
    require("RabbitMQ", amqp_problem())
    names = [f"watch-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    with Connection(AMQP_URL) as conn:
        for name in names:
            Queue(name, Exchange(name), routing_key=name, auto_delete=False)(conn.default_channel).declare()
        made = Watched(conn, names)
        made.watch.watch(names)
        made.read(lambda: made.watch.holds_credit, "the placeholder to take the credit")
        yield made
        made.watch.close()
        for name in names:
            conn.default_channel.queue_delete(name)


def test_a_held_credit_blocks_messages_and_a_give_lets_exactly_one_through(watched):
    a, b = watched.names
    watched.publish(a, "m-a")
    watched.publish(b, "m-b")
    # Both queues are consumed, yet the placeholder holds the one credit: nothing is pushed.
    watched.read_for(10)
    assert watched.deliveries == []
    assert watched.depth(a) == 1 and watched.depth(b) == 1
    watched.give()
    watched.read(lambda: watched.deliveries, "the give to let a message through")
    (queue, message), = watched.deliveries
    # The first delivery took the credit and the placeholder's consumer came back behind it: giving
    # the message back frees the credit, and the placeholder or the other queue's message takes it.
    assert queue not in watched.watch.watched()  # a delivery ends its queue's watch
    other = b if queue == a else a
    assert watched.depth(other) == 1
    watched.watch.give_back(message)
    watched.read(lambda: watched.watch.holds_credit or len(watched.deliveries) > 1, "the credit to be taken again")
    if len(watched.deliveries) > 1:
        # The other queue's message took the freed credit first, and holds it while nobody decides it
        # (the claimer always does, at once): one more, never two, and the placeholder waits behind it.
        watched.read_for(10)
        assert len(watched.deliveries) == 2 and not watched.watch.holds_credit
        watched.watch.give_back(watched.deliveries[1][1])
        # Both queues' watches ended with their deliveries: the freed credit can only go to the placeholder.
        watched.read(lambda: watched.watch.holds_credit, "the placeholder to take the credit back")
        watched.read_for(10)
        assert len(watched.deliveries) == 2
    else:
        watched.read_for(10)
        assert len(watched.deliveries) == 1 and watched.depth(other) == 1


def test_an_admitted_message_keeps_the_credit_beside_it_and_its_ack_does_not_free_one(watched):
    a, b = watched.names
    watched.publish(a, "first")
    watched.watch.unwatch_all()
    watched.watch.watch([a])
    watched.give()
    watched.read(lambda: watched.deliveries, "the give to let the message through")
    _, message = watched.deliveries[0]
    watched.watch.decided(message)  # admitted: its run holds the message unacked
    watched.read(lambda: watched.watch.holds_credit, "the placeholder to take the credit beside the run")
    watched.watch.watch([b])
    message.ack()  # the run ended: the credit was lowered before the ack went out
    watched.publish(b, "second")
    watched.read_for(10)
    assert len(watched.deliveries) == 1
    assert watched.depth(b) == 1


def test_a_message_given_back_stays_at_the_head_of_its_queue_marked_redelivered(watched):
    a, _ = watched.names
    watched.publish(a, "one")
    watched.publish(a, "two")
    watched.give()
    watched.read(lambda: watched.deliveries, "the give to let a message through")
    queue, message = watched.deliveries[0]
    assert (queue, message.decode()) == (a, "one")
    watched.watch.give_back(message)
    channel = watched.conn.channel()
    got = [channel.basic_get(a, no_ack=True) for _ in range(2)]
    assert [raw.body for raw in got] == ['"one"', '"two"']
    assert got[0].delivery_info["redelivered"] is True
    channel.close()
