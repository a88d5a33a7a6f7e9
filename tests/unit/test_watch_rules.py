"""The queue watch's pure rules: the turn a pushed message must not jump, the 5 ms gate on giving its credit."""

from __future__ import annotations

import pytest

from celery_durable.compat.amqp_watch import accepts_global_qos
from celery_durable.planning.known_empty import KnownEmpty
from celery_durable.planning.known_ready import NOTHING_READY_KNOWN, KnownReady, after_delivery, pass_queues, to_probe
from celery_durable.planning.watch_credit import WATCH_CREDIT_EVERY, may_give_credit
from celery_durable.planning.watch_turn import runs_now

ORDER = ("a", "b", "c", "d")
OPEN = {"a": 1, "b": 1, "c": 1, "d": 1}


@pytest.mark.parametrize(("queue", "cursor", "holding", "free", "room", "runs"), [
    ("c", "b", set(), OPEN, 1, True),            # next in turn
    ("c", "a", {"b"}, OPEN, 1, False),           # b is ahead of it and holds work
    ("c", "a", {"d"}, OPEN, 1, True),            # d holds work, but comes after c
    ("c", "d", {"a"}, OPEN, 1, False),           # the turn wraps: after d come a, b, then c
    ("c", "a", {"b"}, {**OPEN, "b": 0}, 1, True),  # b is at its cap: it has no turn to lose
    ("c", "b", set(), OPEN, 0, False),           # no room
    ("c", "b", set(), {**OPEN, "c": 0}, 1, False),  # its queue is at its cap
    ("c", None, {"a"}, OPEN, 1, False),          # no cursor: the turn starts at the first queue
    ("gone", "a", set(), {**OPEN, "gone": 1}, 1, False),  # no longer one of the worker's queues
])
def test_a_pushed_message_runs_only_where_the_turn_would_have_given_it_the_slot(queue, cursor, holding, free,
                                                                                 room, runs):
    assert runs_now(queue, ORDER, cursor, holding, free, room) is runs


def test_the_credit_is_given_at_most_every_5_ms():
    assert may_give_credit(None, 10.0)
    assert not may_give_credit(10.0, 10.0)
    assert not may_give_credit(10.0, 10.0 + WATCH_CREDIT_EVERY * 0.99)
    assert may_give_credit(10.0, 10.0 + WATCH_CREDIT_EVERY)
    assert may_give_credit(10.0, 9.0)  # a clock that went back does not hold the credit
    assert WATCH_CREDIT_EVERY == 0.005


def test_watched_queues_are_never_probed_and_left_out_until_known_to_hold_work():
    free = {"a": 1, "b": 1, "c": 1}
    assert to_probe(NOTHING_READY_KNOWN, ["a", "b", "c"], free, 100.0, frozenset({"b"})) == ["a", "c"]
    order, capped = pass_queues(["a", "b", "c"], None, free, NOTHING_READY_KNOWN, 100.0, frozenset({"b"}))
    assert order == ("a", "c") and "b" not in capped
    known = after_delivery(NOTHING_READY_KNOWN, "b")
    order, capped = pass_queues(["a", "b", "c"], "a", free, known, 100.0, frozenset({"b"}))
    assert order == ("b", "c", "a") and capped["b"] == 1


def test_a_delivery_makes_a_queue_proven_empty_one_that_holds_work():
    known = KnownReady({}, KnownEmpty(frozenset({"a", "b"}), 1.0))
    after = after_delivery(known, "a")
    assert after.counts == {"a": 1}
    assert after.empty == KnownEmpty(frozenset({"b"}), 1.0)
    assert after_delivery(after, "a") is after
    assert after_delivery(KnownReady({"a": 5}), "a").counts == {"a": 5}


@pytest.mark.parametrize(("arguments", "accepts"), [
    (None, True), ({}, True), ({"x-queue-type": "classic"}, True), ({"x-max-priority": 5}, True),
    ({"x-queue-type": "quorum"}, False), ({"x-queue-type": "stream"}, False),
])
def test_quorum_and_stream_queues_stay_probed(arguments, accepts):
    assert accepts_global_qos(arguments) is accepts
