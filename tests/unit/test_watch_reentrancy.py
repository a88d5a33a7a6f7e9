"""A watch delivery read while a claim pass admits is decided after it: no room overshot, no run unbound.

Any synchronous read of the connection (a pass's gets, the idle wait's ``basic.cancel``, a
strategy's confirm) dispatches the queue watch's deliveries. Decided there, inside another
admission, one spent room the pass had already planned, and its admission cleared the outer
run's slot before the strategy bound its request: the outer run's count went back while it ran
(the counting e2e test's ``in_flight 0`` with two runs started, under load).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from kombu import Connection, Queue
from kombu.message import Message

from celery_durable.testing.clock import FakeClock
from celery_durable.worker.admission import Admitter
from celery_durable.worker.claimer import Claimer
from celery_durable.worker.held_runs import HeldRuns
from celery_durable.worker.queue_watch import QueueWatch

_tags = itertools.count(1)


def message(channel: Any, body: str) -> Message:
    return Message(body=json.dumps(body).encode(), delivery_tag=next(_tags), content_type="application/json",
                   content_encoding="utf-8", channel=channel, headers={})


class WatchChannel:
    """py-amqp's channel surface the watch uses; ``read_connection`` dispatches what the broker sent, as any
    synchronous read of the connection (a ``basic.cancel`` waiting for its ``CancelOk``) does."""

    connection = SimpleNamespace(client=SimpleNamespace(transport=SimpleNamespace(driver_type="amqp")))

    def __init__(self) -> None:
        self.callbacks: dict[str, Callable[[Any], None]] = {}
        self.settled: list[tuple[str, int]] = []
        self.sent: list[tuple[str, Any]] = []  # what the broker pushes at the next read: (queue, body)
        self._messages: dict[int, Message] = {}

    def send_method(self, sig: Any, fmt: str, args: Any, wait: Any = None) -> None:
        pass

    def queue_declare(self, **kwargs: Any) -> tuple[str, int, int]:
        return "placeholder", 0, 0

    def basic_publish(self, *args: Any, **kwargs: Any) -> None:
        pass

    def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        self.settled.append(("ack", delivery_tag))

    def basic_reject(self, delivery_tag: int, requeue: bool) -> None:
        self.settled.append(("reject", delivery_tag))

    def message_to_python(self, raw: Any) -> Message:
        return self._messages[raw.delivery_info["delivery_tag"]]

    def read_connection(self) -> None:
        sent, self.sent = self.sent, []
        for queue, body in sent:
            pushed = message(self, body)
            self._messages[pushed.delivery_tag] = pushed
            consumer = next(tag for tag in self.callbacks if tag.endswith(f":{queue}"))
            self.callbacks[consumer](SimpleNamespace(delivery_info={"consumer_tag": consumer,
                                                                    "delivery_tag": pushed.delivery_tag}))

    def close(self) -> None:
        pass


class ProbingGets:
    """A probing fetcher over lists of messages: what RabbitMQ's passes ask, without the broker."""

    def __init__(self, ready: dict[str, list[Message]]) -> None:
        self.ready = ready
        self.round_trips = 0

    def ready_counts(self, queues: Any) -> dict[str, int]:
        return {q: len(self.ready.get(q, [])) for q in queues}

    def remaining(self) -> int | None:
        return None

    def fetch(self, queue: Any, count: int, keep_going: Callable[[], bool]) -> Iterator[Any]:
        for _ in range(count):
            if self.ready.get(queue.name):
                yield self.ready[queue.name].pop(0)


@pytest.fixture
def world() -> Iterator[SimpleNamespace]:
    watch_channel = WatchChannel()
    fetcher = ProbingGets({"q": [], "w": []})
    held = HeldRuns(2, {"q": 2, "w": 2})
    with Connection("memory://") as connection:
        claimer = Claimer(
            connection=connection, queues=lambda: [Queue("q"), Queue("w")], held=held, accept=["json"],
            schedule=lambda fn: None, clock=FakeClock(), new_fetcher=lambda channel, accept: fetcher,
            new_watch=lambda conn, channel, accept, on_delivery, clock: QueueWatch(
                SimpleNamespace(channel=lambda: watch_channel), accept, on_delivery, clock))
        bound: list[Any] = []

        def strategy(msg: Message) -> None:
            # Celery's strategy: something in it reads the connection before it makes the request.
            watch_channel.read_connection()
            request = SimpleNamespace(message=msg)
            claimer.bind_request(request)
            bound.append(msg)

        claimer.handler = strategy
        claimer.start()  # the first pass: both queues probed empty, then watched
        yield SimpleNamespace(claimer=claimer, held=held, fetcher=fetcher, channel=watch_channel, bound=bound)
        claimer.close()


def test_a_watch_delivery_read_mid_admission_waits_for_the_pass_and_goes_back_when_the_room_is_spent(world):
    claimer, held, channel = world.claimer, world.held, world.channel
    assert claimer.stats().watching == {"q", "w"}
    # Work lands on q, which the watch delivers; the pass it kicks asks q in turn.
    world.fetcher.ready["q"] = [message(channel, "a1"), message(channel, "a2")]
    claimer.queues_changed()  # the passes probe q again; w stays to be watched
    claimer.run_pass()
    assert claimer.stats().watching == {"w"}
    # The pass takes both messages of q for its room of 2; while the first is admitted, the
    # strategy's read dispatches a message the broker pushed from the watched queue w.
    world.fetcher.ready["q"] = [message(channel, "b1"), message(channel, "b2")]
    for run in held.snapshot():
        held.give_back(run.message)
    channel.sent.append(("w", "pushed"))
    claimer.run_pass()
    # Every run the pass admitted is bound to its request and holds its count; the room was never overshot.
    assert held.held() == 2 == held.capacity
    assert all(run.request is not None for run in held.snapshot())
    assert sorted(run.message.decode() for run in held.snapshot()) == ["b1", "b2"]
    # The pushed message was decided after the pass, found no room, and went back to w in place.
    stats = claimer.stats()
    assert (stats.claimed_by_watch, stats.watch_given_back) == (0, 1)
    assert channel.settled[-1][0] == "reject"


def test_a_watch_delivery_read_mid_admission_runs_after_it_when_room_is_left(world):
    claimer, held, channel = world.claimer, world.held, world.channel
    world.fetcher.ready["q"] = [message(channel, "a1")]
    claimer.queues_changed()
    channel.sent.append(("w", "pushed"))
    claimer.run_pass()  # q's one message is admitted; its strategy's read brings w's
    assert held.held() == 2
    assert all(run.request is not None for run in held.snapshot())
    assert sorted(run.message.decode() for run in held.snapshot()) == ["a1", "pushed"]
    assert claimer.stats().claimed_by_watch == 1


def test_an_admission_inside_another_leaves_the_outer_run_bound():
    # A second line of defence: admissions nest, so an inner one cannot clear the outer's run.
    held = HeldRuns(2, {"q": 2})
    outer, inner = message(None, "outer"), message(None, "inner")
    admitter: Admitter

    def strategy(msg: Message) -> None:
        if msg is outer:
            admitter.admit("q", inner)
        admitter.bind_request(SimpleNamespace(message=msg))

    admitter = Admitter(held=held, gate=None, handle=strategy, clock=FakeClock())
    assert admitter.admit("q", outer)
    assert held.held() == 2
    assert all(run.request is not None for run in held.snapshot())


def test_an_idle_wait_delivery_finding_the_room_the_watch_spent_goes_back(world):
    # The idle wait was armed for the room a pass left (1 here); the watch, deciding outside any pass,
    # admitted a message into it first. The idle wait's own delivery then finds no room: back in place.
    claimer, held, channel = world.claimer, world.held, world.channel
    held.take("q", message(channel, "running"))
    assert held.room() == 1
    channel.sent.append(("w", "pushed"))
    channel.read_connection()  # the hub's read: the watch's delivery is decided at once
    assert claimer.stats().claimed_by_watch == 1
    idle_delivered = message(channel, "idle")
    claimer._idle_delivered("q", idle_delivered)  # what the idle wait's consumer calls
    assert held.held() == 2 == held.capacity
    assert ("reject", idle_delivered.delivery_tag) in channel.settled
