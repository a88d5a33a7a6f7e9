"""planning/push_turn.py from tables: push only where exactly one queue is open."""

from __future__ import annotations

import pytest

from celery_durable.planning.push_turn import push_queue


@pytest.mark.parametrize(("order", "free", "room", "pushed"), [
    (["a"], {"a": 8}, 8, "a"),                    # one queue: nothing to take turns with
    (["a", "b"], {"a": 0, "b": 3}, 2, "b"),       # a at its per-queue cap has no turn to lose
    (["a", "b"], {"a": 1, "b": 3}, 2, None),      # two open: the rotated turn
    (["a", "b", "c"], {"a": 0, "b": 0, "c": 0}, 2, None),
    (["a"], {"a": 8}, 0, None),                   # no room: no queue is open, and none was served
    (["a", "b"], {"a": 2}, 2, "a"),               # a queue with no slots recorded is not open
])
def test_push_queue(order, free, room, pushed):
    assert push_queue(order, free, room) == pushed


@pytest.mark.parametrize(("free", "room", "serving", "pushed"), [
    ({"a": 0, "b": 0}, 0, "a", "a"),    # full: keeps serving a (cancelling would re-start it per run)
    ({"a": 0, "b": 0}, 0, None, None),  # full, in the rotated turn: stays there
    ({"a": 1, "b": 1}, 2, "a", None),   # room and two open: back to the turn, whatever was served
    ({"a": 0, "b": 1}, 1, "a", "b"),    # room and one open: that one
])
def test_a_full_worker_keeps_the_mode_it_is_in(free, room, serving, pushed):
    assert push_queue(["a", "b"], free, room, serving) == pushed


def test_a_queue_that_takes_no_push_consumer_stays_in_the_turn():
    # RabbitMQ's quorum queues refuse a consumer on a channel with a global basic.qos.
    assert push_queue(["q"], {"q": 2}, 2, pushable={"a"}) is None
    assert push_queue(["a", "q"], {"a": 0, "q": 2}, 2, pushable={"a"}) is None
    assert push_queue(["a", "q"], {"a": 2, "q": 0}, 2, pushable={"a"}) == "a"
