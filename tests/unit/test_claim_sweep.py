"""The claim-sweep planner, from tables: which queue is asked, in what order, for how many."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest

from celery_durable.errors import InvariantBroken
from celery_durable.planning.claim_sweep import (
    MAX_OVERDRAW,
    Ask,
    begin_sweep,
    next_ask,
    overdraw_after,
    overdrawn,
    record,
    rotate,
    skip_to,
    waitable_queues,
)


@dataclass
class Pass:
    asks: list[tuple[str, int]]
    claims: list[tuple[str, int]]
    cursor: str | None
    claimed: int


def simulate(
    queues: Sequence[str],
    backlog: dict[str, int],
    free: Mapping[str, int],
    room: int | None,
    cursor: str | None = None,
) -> Pass:
    """Run one pass against ``backlog`` (mutated: what a queue gives is gone from it)."""
    sweep = begin_sweep(queues, free, room, cursor)
    asks: list[tuple[str, int]] = []
    claims: list[tuple[str, int]] = []
    # A pass asks each queue at most once per slot it has; more means the planner loops.
    limit = len(queues) + sum(free.values()) + 1
    while True:
        ask, sweep = next_ask(sweep)
        if ask is None:
            break
        assert len(asks) < limit, f"the pass did not end: {asks}"
        assert ask.count >= 1, ask
        got = min(ask.count, backlog.get(ask.queue, 0))
        backlog[ask.queue] = backlog.get(ask.queue, 0) - got
        asks.append((ask.queue, ask.count))
        if got:
            claims.append((ask.queue, got))
        sweep = record(sweep, ask, got)
    return Pass(asks=asks, claims=claims, cursor=sweep.cursor, claimed=sweep.claimed)


def totals(claims: Sequence[tuple[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for queue, got in claims:
        out[queue] = out.get(queue, 0) + got
    return out


# -- one pass, from a table ------------------------------------------------------------

PASSES = [
    pytest.param(
        ["a", "b", "c"], {"a": 1, "b": 10, "c": 10}, {"a": 8, "b": 8, "c": 8}, 6, None,
        [("a", 2), ("b", 3), ("c", 2)],
        [("a", 1), ("b", 3), ("c", 2)],
        id="less-work-than-share-leaves-the-rest-to-later-queues",
    ),
    pytest.param(
        ["a", "b"], {"a": 10, "b": 1}, {"a": 8, "b": 8}, 6, None,
        [("a", 3), ("b", 3), ("a", 2)],
        [("a", 3), ("b", 1), ("a", 2)],
        id="a-queue-that-filled-its-share-is-asked-again-while-room-is-left",
    ),
    pytest.param(
        ["a", "b"], {"a": 10, "b": 10}, {"a": 2, "b": 8}, 6, None,
        [("a", 2), ("b", 4)],
        [("a", 2), ("b", 4)],
        id="slots-not-share-bound-the-ask-so-it-is-not-asked-again",
    ),
    pytest.param(
        ["a", "b", "c"], {"a": 10, "b": 10, "c": 10}, {"a": 0, "b": 8, "c": 8}, 2, None,
        [("b", 1), ("c", 1)],
        [("b", 1), ("c", 1)],
        id="a-queue-at-its-slot-limit-is-skipped-not-asked",
    ),
    pytest.param(
        ["a", "b", "c"], {"a": 10, "b": 10, "c": 10}, {"a": 0, "b": 0, "c": 0}, 5, None,
        [], [],
        id="every-queue-at-its-slot-limit-asks-nothing",
    ),
    pytest.param(
        ["a", "b", "c"], {"a": 100, "b": 100, "c": 100}, {"a": 3, "b": 5, "c": 2}, None, None,
        [("a", 3), ("b", 5), ("c", 2)],
        [("a", 3), ("b", 5), ("c", 2)],
        id="no-process-cap-asks-each-queue-once-for-its-free-slots",
    ),
    pytest.param(
        ["a", "b"], {"a": 0, "b": 1}, {"a": 4, "b": 4}, None, None,
        [("a", 4), ("b", 4)],
        [("b", 1)],
        id="no-process-cap-asks-once-even-when-a-queue-is-empty",
    ),
    pytest.param(
        ["a", "b", "c"], {"a": 10, "b": 10, "c": 10}, {"a": 8, "b": 8, "c": 8}, 0, None,
        [], [],
        id="room-zero-asks-nothing",
    ),
    pytest.param(
        ["a", "b", "c"], {"a": 10, "b": 10, "c": 10}, {"a": 8, "b": 8, "c": 8}, 1, "b",
        [("c", 1)],
        [("c", 1)],
        id="rotation-starts-after-the-cursor",
    ),
    pytest.param(
        ["a", "b", "c"], {"a": 10, "b": 10, "c": 10}, {"a": 8, "b": 8, "c": 8}, 1, "c",
        [("a", 1)],
        [("a", 1)],
        id="rotation-after-the-last-queue-wraps-to-the-first",
    ),
    pytest.param(
        ["a", "b", "c"], {"a": 10, "b": 10, "c": 10}, {"a": 8, "b": 8, "c": 8}, 1, "gone",
        [("a", 1)],
        [("a", 1)],
        id="a-cursor-no-longer-consumed-starts-at-the-first-queue",
    ),
    pytest.param(
        ["a", "b", "c"], {"a": 0, "b": 0, "c": 10}, {"a": 8, "b": 8, "c": 8}, 1, None,
        [("a", 1), ("b", 1), ("c", 1)],
        [("c", 1)],
        id="empty-queues-pass-the-turn-to-one-with-work",
    ),
    pytest.param(
        ["a", "b", "c"], {"a": 0, "b": 0, "c": 0}, {"a": 8, "b": 8, "c": 8}, 3, None,
        [("a", 1), ("b", 2), ("c", 3)],
        [],
        id="no-work-anywhere-asks-each-queue-once-and-ends",
    ),
    pytest.param(
        ["a"], {"a": 100}, {"a": 8}, 20, None,
        [("a", 8)],
        [("a", 8)],
        id="room-above-slots-is-capped-by-slots",
    ),
    pytest.param(
        ["a", "b"], {"a": 100, "b": 100}, {"a": 5, "b": 5}, 7, "a",
        [("b", 4), ("a", 3)],
        [("b", 4), ("a", 3)],
        id="cursor-queue-gets-the-smaller-share",
    ),
]


@pytest.mark.parametrize("queues, backlog, free, room, cursor, asks, claims", PASSES)
def test_one_pass(queues, backlog, free, room, cursor, asks, claims):
    before = dict(backlog)
    result = simulate(queues, backlog, free, room, cursor)
    assert result.asks == asks
    assert result.claims == claims
    assert result.claimed == sum(got for _, got in claims)
    got = totals(claims)
    for queue in queues:
        # Never more than the queue's free slots, nor more than the room.
        assert got.get(queue, 0) <= free[queue]
        assert backlog[queue] == before[queue] - got.get(queue, 0)
    if room is not None:
        assert result.claimed <= room
    if claims:
        assert result.cursor == claims[-1][0]
    else:
        assert result.cursor == cursor


def test_a_pass_fills_its_room_whenever_some_queue_has_the_work():
    # Work exists beyond the room in one queue only: every unit of room is used.
    result = simulate(["a", "b", "c"], {"a": 0, "b": 0, "c": 50}, {"a": 8, "b": 8, "c": 8}, 5)
    assert result.claimed == 5
    assert totals(result.claims) == {"c": 5}


# -- successive passes: the cursor carried from one pass to the next -------------------------

@pytest.mark.parametrize(
    "queues, backlog, expected",
    [
        pytest.param(["a", "b", "c"], {"a": 6, "b": 6, "c": 6}, list("abc" * 6), id="three-backlogged"),
        pytest.param(["a", "b", "c"], {"a": 1, "b": 4, "c": 2}, list("abcbcbb"), id="uneven-backlogs"),
        pytest.param(["a", "b"], {"a": 0, "b": 3}, list("bbb"), id="one-empty"),
    ],
)
def test_room_one_takes_turns_across_passes(queues, backlog, expected):
    free = {q: 8 for q in queues}
    cursor: str | None = None
    order: list[str] = []
    for _ in range(len(expected) + 2):
        # Each pass: the previous run finished, so the room is 1 again.
        result = simulate(queues, backlog, free, 1, cursor)
        assert result.claimed <= 1
        order += [queue for queue, _ in result.claims]
        cursor = result.cursor
    assert order == expected
    assert all(left == 0 for left in backlog.values())


def test_room_one_never_gives_a_queue_two_turns_running_while_others_wait():
    queues = ["a", "b", "c"]
    backlog = {"a": 50, "b": 50, "c": 50}
    cursor: str | None = None
    order: list[str] = []
    for _ in range(30):
        result = simulate(queues, backlog, {q: 8 for q in queues}, 1, cursor)
        order += [queue for queue, _ in result.claims]
        cursor = result.cursor
    assert order == list("abc" * 10)


# -- invariants ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "queues, free, room, fragment",
    [
        pytest.param(["a", "a"], {"a": 1}, 1, "distinct", id="duplicate-queues"),
        pytest.param(["a", "b"], {"a": 1, "b": -1}, 1, "'b'", id="negative-free"),
        pytest.param(["a", "b"], {"a": 1}, 1, "'b'", id="missing-free"),
        pytest.param(["a"], {"a": 1}, -1, "room", id="negative-room"),
    ],
)
def test_begin_sweep_refuses_broken_invariants(queues, free, room, fragment):
    with pytest.raises(InvariantBroken) as err:
        begin_sweep(queues, free, room, None)
    assert fragment in str(err.value)


@pytest.mark.parametrize("got", [3, -1], ids=["more-than-asked", "negative"])
def test_record_refuses_a_count_the_ask_could_not_bring(got):
    sweep = begin_sweep(["a"], {"a": 8}, 5, None)
    ask, sweep = next_ask(sweep)
    assert ask == Ask("a", 5, share_bound=True)
    # An ask for 2, whatever the plan: record checks got against the ask it is given.
    with pytest.raises(InvariantBroken) as err:
        record(sweep, Ask("a", 2, share_bound=True), got)
    assert "'a'" in str(err.value)


def test_begin_sweep_does_not_keep_the_callers_free_dict():
    free = {"a": 2}
    sweep = begin_sweep(["a"], free, None, None)
    free["a"] = 0
    ask, _ = next_ask(sweep)
    assert ask == Ask("a", 2, share_bound=False)


def test_share_bound_is_set_only_when_the_share_cut_the_ask():
    sweep = begin_sweep(["a", "b"], {"a": 8, "b": 1}, 4, None)
    first, sweep = next_ask(sweep)
    assert first == Ask("a", 2, share_bound=True)
    sweep = record(sweep, first, 2)
    second, sweep = next_ask(sweep)
    assert second == Ask("b", 1, share_bound=False)


# -- helpers ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "queues, cursor, expected",
    [
        (["a", "b", "c"], None, ("a", "b", "c")),
        (["a", "b", "c"], "a", ("b", "c", "a")),
        (["a", "b", "c"], "b", ("c", "a", "b")),
        (["a", "b", "c"], "c", ("a", "b", "c")),
        (["a", "b", "c"], "x", ("a", "b", "c")),
        ([], "a", ()),
    ],
)
def test_rotate(queues, cursor, expected):
    assert rotate(queues, cursor) == expected


@pytest.mark.parametrize(
    "queues, free, room, expected",
    [
        pytest.param(["a", "b", "c"], {"a": 1, "b": 0, "c": 3}, 2, ("a", "c"), id="free-slots-only"),
        pytest.param(["a", "b", "c"], {"a": 1, "b": 1, "c": 1}, None, ("a", "b", "c"), id="no-cap"),
        pytest.param(["a", "b"], {"a": 1, "b": 1}, 0, (), id="no-room"),
        pytest.param(["a", "b"], {"a": 0, "b": 0}, 4, (), id="all-full"),
        pytest.param(["c", "a", "b"], {"a": 1, "b": 1, "c": 1}, 1, ("c", "a", "b"), id="keeps-order"),
        pytest.param(["a", "b"], {"a": 2}, 1, ("a",), id="unknown-queue-is-not-waitable"),
    ],
)
def test_waitable_queues(queues, free, room, expected):
    assert waitable_queues(queues, free, room) == expected


@pytest.mark.parametrize("seed", range(200))
def test_replaying_only_the_asks_that_took_messages_lands_where_the_whole_pass_does(seed):
    # A broker that runs the pass whole reports the asks that took messages;
    # skip_to then next_ask must rebuild each of them, and the pass's end state.
    rng = random.Random(seed)
    queues = [f"q{i}" for i in range(rng.randint(1, 8))]
    backlog = {q: rng.choice([0, 0, 1, 2, 5]) for q in queues}
    free = {q: rng.randint(0, 4) for q in queues}
    room = rng.choice([None, *range(0, 9)])
    cursor = rng.choice([None, *queues])
    sweep = begin_sweep(queues, free, room, cursor)
    full, taken, left = sweep, [], dict(backlog)
    while True:
        ask, full = next_ask(full)
        if ask is None:
            break
        got = min(ask.count, left[ask.queue])
        left[ask.queue] -= got
        if got:
            taken.append((ask, got))
        full = record(full, ask, got)

    replay = sweep
    for ask, got in taken:
        again, replay = next_ask(skip_to(replay, ask.queue))
        assert again == ask
        replay = record(replay, again, got)
    assert (replay.claimed, replay.cursor, dict(replay.free), replay.room) == \
        (full.claimed, full.cursor, dict(full.free), full.room)


def test_skip_to_refuses_a_queue_with_no_ask_left_in_the_pass():
    sweep = begin_sweep(["a", "b"], {"a": 1, "b": 1}, 2, None)
    _, sweep = next_ask(sweep)
    with pytest.raises(InvariantBroken, match="'a' has no ask left"):
        skip_to(sweep, "a")


# -- the overdraw: a pass whose messages waited takes more next time -------------------------------
def test_the_overdraw_doubles_while_passes_park_and_ends_when_none_wait():
    assert overdraw_after(went_to_wait=3, handed_back=0) == 6
    assert overdraw_after(went_to_wait=6, handed_back=0) == 12
    assert overdraw_after(went_to_wait=500, handed_back=0) == MAX_OVERDRAW
    assert overdraw_after(went_to_wait=0, handed_back=0) == 0


def test_messages_given_back_pull_the_overdraw_down_to_a_balance():
    """Half the messages wait, half could run, room 4: the overdraw settles where a pass gives back
    fewer than it parks (each given-back message costs a round trip for nothing)."""
    extra, seen = 0, []
    for _ in range(20):
        taken = 4 + extra
        waited, runnable = taken // 2, taken - taken // 2
        given_back = max(runnable - 4, 0)
        extra = overdraw_after(waited, given_back)
        seen.append((extra, waited, given_back))
    steady = seen[10:]
    assert {extra for extra, _, _ in steady} <= {10, 11}, seen
    assert all(given_back < waited for _, waited, given_back in steady), seen
    assert overdraw_after(went_to_wait=2, handed_back=10) == 0


def test_overdrawn_adds_to_queues_with_a_free_slot_only_and_never_to_a_full_worker():
    assert overdrawn({"a": 2, "b": 0}, 3, 8) == ({"a": 10, "b": 0}, 11)
    assert overdrawn({"a": 2}, 0, 8) == ({"a": 2}, 0)
    assert overdrawn({"a": 2}, 3, 0) == ({"a": 2}, 3)
