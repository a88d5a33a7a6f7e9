"""worker/push_consumer.py on a recording channel: the credit the broker sees is never more than the room."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from amqp import spec

from celery_durable.worker.push_consumer import PushConsumer


class RecordingChannel:
    """py-amqp's channel surface the push consumer writes to; frames recorded in order."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, Any]] = []
        self.callbacks: dict[str, Any] = {}

    def send_method(self, sig: Any, fmt: str, args: Any, wait: Any = None) -> None:
        name = {spec.Basic.Qos: "qos", spec.Basic.Consume: "consume", spec.Basic.Cancel: "cancel"}[sig]
        self.frames.append((name, args[1] if name == "qos" else args[2] if name == "consume" else args[0]))

    def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        self.frames.append(("ack", delivery_tag))

    def basic_reject(self, delivery_tag: int, requeue: bool) -> None:
        self.frames.append(("reject", delivery_tag))

    def message_to_python(self, raw: Any) -> Any:
        return SimpleNamespace(raw=raw, delivery_tag=raw.delivery_info["delivery_tag"])


class World:
    """A worker's room and held runs, as the claimer hands them to the push consumer."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.held: dict[int, str] = {}  # delivery tag -> "early" | "late"
        self.channel = RecordingChannel()
        self.push = PushConsumer(SimpleNamespace(channel=lambda: self.channel), ["json"],
                                 lambda queue: self.room, self.admit,
                                 lambda m: m.delivery_tag in self.held,
                                 lambda m: self.held.get(m.delivery_tag) == "late")
        self.acks = "early"

    def admit(self, queue: str, message: Any) -> None:
        self.held[message.delivery_tag] = self.acks
        self.room -= 1

    def deliver(self, tag: int) -> None:
        consumer_tag = next(t for t in self.channel.callbacks)
        info = {"consumer_tag": consumer_tag, "delivery_tag": tag}
        self.channel.callbacks[consumer_tag](SimpleNamespace(delivery_info=info))

    def end(self, tag: int) -> None:
        del self.held[tag]
        self.room += 1

    def names(self) -> list[str]:
        return [name for name, _ in self.channel.frames]


def test_serving_sets_the_credit_to_the_room_before_consuming():
    w = World(room=3)
    w.push.serve("q")
    assert w.channel.frames[0] == ("qos", 3)
    assert w.names() == ["qos", "consume"]
    assert w.push.queue == "q"


def test_an_early_ack_lowers_the_credit_before_the_ack_and_a_full_worker_cancels():
    w = World(room=2)
    w.push.serve("q")
    w.deliver(1)
    w.deliver(2)
    del w.channel.frames[:]
    w.channel.basic_ack(1)  # the run goes on: the broker must not read the ack as a free slot
    assert w.channel.frames == [("qos", 1), ("ack", 1)]
    del w.channel.frames[:]
    w.channel.basic_ack(2)  # room 0 and nothing the broker counts: a prefetch of 0 means unlimited
    assert w.names() == ["cancel", "ack"]
    w.end(1)
    del w.channel.frames[:]
    w.push.serve("q")  # the pass a run's end kicks
    assert w.names() == ["consume"] and w.push.queue == "q"


def test_a_late_ack_as_the_run_ends_moves_nothing():
    w = World(room=2)
    w.acks = "late"
    w.push.serve("q")
    w.deliver(1)
    del w.channel.frames[:]
    w.channel.basic_ack(1)
    w.end(1)
    w.push.serve("q")
    assert w.channel.frames == [("ack", 1)]


def test_a_run_given_back_before_its_ack_is_not_counted():
    # The thread pool gives the slot back, then the loop acks: the pass between must not raise the credit.
    w = World(room=2)
    w.push.serve("q")
    w.deliver(1)
    w.end(1)
    del w.channel.frames[:]
    w.push.serve("q")
    w.channel.basic_ack(1)
    assert w.channel.frames == [("ack", 1)]


def test_a_delivery_after_the_cancel_still_reaches_the_claimer():
    w = World(room=2)
    w.push.serve("q")
    consumer_tag = next(iter(w.channel.callbacks))
    w.push.stop()
    assert w.push.queue is None and ("cancel", consumer_tag) in w.channel.frames
    w.channel.callbacks[consumer_tag](SimpleNamespace(delivery_info={"consumer_tag": consumer_tag,
                                                                     "delivery_tag": 7}))
    assert 7 in w.held  # handed to the claimer, which admits it or gives it back
