"""worker/queue_watch.py on a recording channel: the broker may push at most one message not yet started."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

from amqp import spec

from celery_durable.testing.clock import FakeClock
from celery_durable.worker.queue_watch import QueueWatch

_tags = itertools.count(100)


class RecordingChannel:
    """py-amqp's channel surface the watch writes to; frames recorded in order."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, Any]] = []
        self.callbacks: dict[str, Any] = {}

    def send_method(self, sig: Any, fmt: str, args: Any, wait: Any = None) -> None:
        name = {spec.Basic.Qos: "qos", spec.Basic.Consume: "consume", spec.Basic.Cancel: "cancel",
                spec.Basic.Reject: "reject-placeholder"}[sig]
        value = {"qos": lambda: args[1], "consume": lambda: args[1], "cancel": lambda: args[0],
                 "reject-placeholder": lambda: args[0]}[name]()
        self.frames.append((name, value))
        assert wait is None, "the watch never waits for a reply"

    def queue_declare(self, **kwargs: Any) -> tuple[str, int, int]:
        assert kwargs["exclusive"] and not kwargs["auto_delete"]
        return "amq.gen-placeholder", 0, 0

    def basic_publish(self, message: Any, exchange: str, routing_key: str) -> None:
        self.frames.append(("publish", routing_key))

    def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        self.frames.append(("ack", delivery_tag))

    def basic_reject(self, delivery_tag: int, requeue: bool) -> None:
        self.frames.append(("reject", delivery_tag))

    def message_to_python(self, raw: Any) -> Any:
        tag = raw.delivery_info["delivery_tag"]
        return SimpleNamespace(delivery_tag=tag, reject=lambda requeue: self.basic_reject(tag, requeue),
                               ack=lambda: self.basic_ack(tag))

    def push(self, queue: str) -> int:
        """The broker delivers to ``queue``'s consumer (the placeholder's: ``queue=""``)."""
        consumer = next(t for t in reversed(self.callbacks) if t.endswith(f":{queue}"))
        tag = next(_tags)
        self.callbacks[consumer](SimpleNamespace(delivery_info={"consumer_tag": consumer, "delivery_tag": tag}))
        return tag

    def since(self, mark: int) -> list[tuple[str, Any]]:
        return self.frames[mark:]


class World:
    def __init__(self) -> None:
        self.channel = RecordingChannel()
        self.clock = FakeClock()
        self.delivered: list[tuple[str, Any]] = []
        self.watch = QueueWatch(SimpleNamespace(channel=lambda: self.channel), ["json"],
                                lambda q, m: self.delivered.append((q, m)), self.clock)

    def holding(self) -> int:
        """Watch q1 and q2, the placeholder delivered: the credit is held. Returns its delivery tag."""
        self.watch.watch(["q1", "q2"])
        tag = self.channel.push("")
        assert self.watch.holds_credit
        return tag

    def give(self) -> None:
        self.clock.advance(1.0)
        assert self.watch.give()


def test_opening_sets_the_credit_to_one_before_any_consumer_and_the_placeholder_takes_it():
    world = World()
    world.watch.watch(["q1", "q2"])
    assert world.channel.frames == [
        ("publish", "amq.gen-placeholder"),  # the placeholder, alone in its private queue
        ("qos", 1),
        ("consume", "amq.gen-placeholder"),  # first: it takes the one credit before any watched queue can
        ("consume", "q1"),
        ("consume", "q2"),
    ]
    assert not world.watch.holds_credit  # not until the placeholder is delivered
    assert not world.watch.give()
    world.channel.push("")
    assert world.watch.holds_credit
    assert world.watch.watched() == {"q1", "q2"}


def test_a_give_cancels_the_placeholder_consumer_before_putting_it_back_and_waits_5_ms_for_the_next():
    world = World()
    placeholder = world.holding()
    consumer = next(t for t in world.channel.callbacks if t.endswith(":"))
    mark = len(world.channel.frames)
    world.give()
    assert world.channel.since(mark) == [("cancel", consumer), ("reject-placeholder", placeholder)]
    assert world.watch.credits_given == 1
    assert not world.watch.holds_credit
    assert not world.watch.give()  # nothing to give until the placeholder is back
    # A message takes the credit: the placeholder's consumer starts again at once behind it.
    mark = len(world.channel.frames)
    world.channel.push("q1")
    (took_back, placeholder_queue), (cancel, watch_tag) = world.channel.since(mark)
    assert (took_back, placeholder_queue) == ("consume", "amq.gen-placeholder")
    assert cancel == "cancel" and watch_tag.endswith(":q1")  # a delivery ends its queue's watch
    assert world.watch.watched() == {"q2"}
    world.channel.push("")
    world.clock.advance(0.004)
    assert not world.watch.give()  # 5 ms have not passed since the last give
    world.clock.advance(0.002)
    assert world.watch.give()


def _pushed_one(queue: str = "q1") -> tuple[World, Any]:
    """A watch holding the credit, given it, and pushed one message from ``queue``."""
    world = World()
    world.holding()
    world.give()
    world.channel.push(queue)
    _, message = world.delivered[0]
    return world, message


def test_an_admitted_message_raises_the_credit_and_its_ack_lowers_it_first():
    world, message = _pushed_one()
    mark = len(world.channel.frames)
    world.watch.decided(message)
    assert world.channel.since(mark) == [("qos", 2)]  # room for the placeholder beside the run
    world.channel.push("")
    mark = len(world.channel.frames)
    message.ack()
    # Lowered before the ack is written: the broker never sees the freed credit.
    assert world.channel.since(mark) == [("qos", 1), ("ack", message.delivery_tag)]


def test_a_message_given_back_moves_no_credit_and_an_early_ack_during_admission_moves_none():
    world, message = _pushed_one()
    mark = len(world.channel.frames)
    world.watch.give_back(message)
    assert world.channel.since(mark) == [("reject", message.delivery_tag)]
    world.channel.push("")
    world.give()
    world.channel.push("q2")
    _, early = world.delivered[1]
    early.ack()  # the strategy acked it early, before it was counted
    mark = len(world.channel.frames)
    world.watch.decided(early)
    assert world.channel.since(mark) == []  # settled: the placeholder takes the credit it freed


def test_unwatching_cancels_every_watched_queue_and_a_delivery_on_a_cancelled_tag_still_comes():
    world = World()
    world.holding()
    world.give()
    mark = len(world.channel.frames)
    world.watch.unwatch_all()
    assert [name for name, _ in world.channel.since(mark)] == ["cancel", "cancel"]
    assert world.watch.watched() == frozenset()
    assert not world.watch.give()  # nothing watched, nothing to give
    world.channel.push("q1")  # sent before the broker took the cancel
    assert [q for q, _ in world.delivered] == ["q1"]
