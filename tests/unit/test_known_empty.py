"""planning/known_empty.py: which queues a claim pass may leave out, and for how long."""

from __future__ import annotations

from celery_durable.planning.claim_sweep import begin_sweep, next_ask, passed_over, record, skip_to, unanswered
from celery_durable.planning.known_empty import (
    KNOWN_EMPTY_FOR,
    NOTHING_KNOWN,
    KnownEmpty,
    after_pass,
    notified,
    pass_order,
)

QUEUES = ("a", "b", "c", "d")


def test_with_nothing_known_a_pass_is_full_and_rotated_after_the_cursor():
    assert pass_order(QUEUES, "b", NOTHING_KNOWN, now=10.0) == (("c", "d", "a", "b"), True)


def test_queues_known_empty_are_left_out_after_rotating_the_whole_order():
    # The turn is the whole order's: the cursor "b" is itself known empty (drained), and the pass
    # still starts after it, not at the head of what is left.
    known = KnownEmpty(frozenset({"b", "d"}), full_at=10.0)
    assert pass_order(QUEUES, "b", known, now=10.01) == (("c", "a"), False)


def test_what_a_full_pass_proved_is_trusted_for_known_empty_for_seconds_only():
    known = KnownEmpty(frozenset({"a"}), full_at=10.0)
    assert pass_order(QUEUES, None, known, now=10.0 + KNOWN_EMPTY_FOR / 2)[1] is False
    assert pass_order(QUEUES, None, known, now=10.0 + KNOWN_EMPTY_FOR + 0.001) == (QUEUES, True)


def test_a_pass_that_would_leave_out_every_queue_is_full():
    known = KnownEmpty(frozenset(QUEUES), full_at=10.0)
    assert pass_order(QUEUES, None, known, now=10.0) == (QUEUES, True)


def test_a_full_pass_replaces_what_was_known_and_restarts_the_clock_a_narrowed_one_adds():
    known = KnownEmpty(frozenset({"a", "b"}), full_at=1.0)
    assert after_pass(known, full=True, now=5.0, emptied=["c"]) == KnownEmpty(frozenset({"c"}), 5.0)
    assert after_pass(known, full=False, now=5.0, emptied=["c"]) == KnownEmpty(frozenset({"a", "b", "c"}), 1.0)


def test_a_notification_takes_its_queues_out_and_a_possibly_missed_one_forgets_everything():
    known = KnownEmpty(frozenset({"a", "b"}), full_at=1.0)
    assert notified(known, {"b", "z"}) == KnownEmpty(frozenset({"a"}), 1.0)
    assert notified(known, set()) is known
    assert notified(known, None) == NOTHING_KNOWN


def test_the_replay_names_the_queues_a_pass_asked_that_gave_nothing():
    # Room 2 over a, b, c, d (2 free slots each but c with none): the broker reports one ask, on d.
    sweep = begin_sweep(QUEUES, {"a": 2, "b": 2, "c": 0, "d": 2}, 2, None)
    assert passed_over(sweep, "d") == ("a", "b")  # c had no free slot: not asked, so not proved empty
    ask, sweep = next_ask(skip_to(sweep, "d"))
    sweep = record(sweep, ask, 1)
    # Room is left at the end: every queue still to ask with a free slot was asked and gave nothing.
    assert unanswered(sweep) == ()
    full = begin_sweep(QUEUES, {"a": 1, "b": 1, "c": 1, "d": 1}, 1, None)
    ask, full = next_ask(skip_to(full, "a"))
    full = record(full, ask, 1)
    assert unanswered(full) == ()  # the room ran out: the queues after "a" were never asked


def test_a_pass_that_ends_with_room_left_proves_every_queue_it_did_not_hear_from_empty():
    sweep = begin_sweep(QUEUES, {"a": 2, "b": 2, "c": 0, "d": 2}, 5, None)
    ask, sweep = next_ask(skip_to(sweep, "b"))
    sweep = record(sweep, ask, 1)  # asked 2, gave 1
    assert sweep.room == 4
    assert unanswered(sweep) == ("d",)


def test_a_queue_asked_again_in_the_next_round_passes_over_the_rest_of_this_one():
    sweep = begin_sweep(("a", "b", "c"), {"a": 3, "b": 3, "c": 3}, 3, None)
    ask, sweep = next_ask(skip_to(sweep, "a"))
    sweep = record(sweep, ask, 1)  # share 1 of 3, filled: asked again
    assert sweep.again == ("a",)
    assert passed_over(sweep, "a") == ("b", "c")
