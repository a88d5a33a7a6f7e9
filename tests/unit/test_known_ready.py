"""The RabbitMQ probing rules: which queues a pass probes, asks or leaves out (planning/known_ready.py)."""

from __future__ import annotations

import pytest

from celery_durable.planning.known_empty import KnownEmpty
from celery_durable.planning.known_ready import (
    NOTHING_READY_KNOWN,
    PROBED_EMPTY_FOR,
    KnownReady,
    after_ask,
    after_probe,
    pass_queues,
    to_probe,
    trusted_empty,
)

QUEUES = [f"q{i}" for i in range(50)]
FREE = dict.fromkeys(QUEUES, 2)


def probed_once(now: float = 0.0) -> KnownReady:
    """50 queues probed at ``now``: work on q49 only."""
    return after_probe(NOTHING_READY_KNOWN, {q: (5 if q == "q49" else 0) for q in QUEUES}, now)


def test_nothing_known_probes_every_open_queue() -> None:
    assert to_probe(NOTHING_READY_KNOWN, QUEUES, FREE, 0.0) == QUEUES


def test_one_open_queue_is_asked_not_probed() -> None:
    assert to_probe(NOTHING_READY_KNOWN, QUEUES, {**dict.fromkeys(QUEUES, 0), "q0": 2}, 0.0) == []


def test_after_a_probe_nothing_is_probed_while_the_empty_ones_are_trusted() -> None:
    known = probed_once()
    assert to_probe(known, QUEUES, FREE, PROBED_EMPTY_FOR) == []
    assert known.counts == {"q49": 5}


def test_empty_queues_are_probed_again_once_their_proof_is_older_than_the_bound() -> None:
    known = probed_once()
    # Only the ones found empty: the busy queue is known from its GetOk, never probed.
    assert to_probe(known, QUEUES, FREE, PROBED_EMPTY_FOR + 0.001) == QUEUES[:-1]


def test_a_queue_at_its_slot_limit_is_not_probed() -> None:
    assert to_probe(NOTHING_READY_KNOWN, QUEUES, {**FREE, "q3": 0}, 0.0) == [q for q in QUEUES if q != "q3"]


def test_a_clock_that_went_back_trusts_nothing() -> None:
    assert trusted_empty(probed_once(now=1.0), 0.5) == frozenset()


def test_a_queue_known_to_hold_work_is_never_probed_however_old() -> None:
    known = after_ask(probed_once(), "q49", asked=1, got=1, remaining=4, now=0.001)
    assert "q49" not in to_probe(known, QUEUES, FREE, 100.0)
    assert known.counts["q49"] == 4


@pytest.mark.parametrize(("asked", "got", "remaining"), [(2, 1, 0), (2, 0, None), (1, 1, 0)])
def test_an_ask_that_came_back_short_or_left_nothing_proves_its_queue_empty(
        asked: int, got: int, remaining: int | None) -> None:
    known = after_ask(probed_once(), "q49", asked=asked, got=got, remaining=remaining, now=0.001)
    assert "q49" not in known.counts
    assert "q49" in trusted_empty(known, 0.002)
    # It joins the older proofs: probed again no later than they are.
    assert known.empty.full_at == 0.0


def test_an_ask_with_no_count_said_leaves_its_queue_unknown() -> None:
    known = after_ask(probed_once(), "q49", asked=1, got=1, remaining=None, now=0.001)
    assert to_probe(known, QUEUES, FREE, 0.002) == ["q49"]


def test_a_probe_of_only_the_unknown_queues_keeps_the_older_proofs_time() -> None:
    known = KnownReady({"q49": 3}, KnownEmpty(frozenset(QUEUES[:40]), 0.0))
    assert to_probe(known, QUEUES, FREE, 0.005) == QUEUES[40:49]
    known = after_probe(known, {q: 0 for q in QUEUES[40:49]}, 0.006)
    assert known.empty == KnownEmpty(frozenset(QUEUES[:49]), 0.0)


def test_a_fresh_probe_after_the_bound_restarts_the_proofs_and_learns_new_work() -> None:
    known = probed_once()
    later = PROBED_EMPTY_FOR * 2
    known = after_probe(known, {q: (1 if q == "q7" else 0) for q in QUEUES[:-1]}, later)
    assert known.counts == {"q49": 5, "q7": 1}
    assert known.empty == KnownEmpty(frozenset(QUEUES[:-1]) - {"q7"}, later)


def test_the_pass_leaves_out_trusted_empty_queues_after_rotating_the_whole_order() -> None:
    known = KnownReady({"a": 2, "c": 9}, KnownEmpty(frozenset({"b", "x", "y"}), 0.0))
    order, free = pass_queues(["a", "b", "c", "x", "y"], "b", {q: 4 for q in "abcxy"}, known, 0.001)
    # The turn after b (known empty, so not asked) starts at c, as the whole order's rotation does.
    assert order == ("c", "a")
    assert free == {"c": 4, "a": 2}


def test_the_pass_asks_every_queue_once_the_proofs_expire() -> None:
    known = KnownReady({"a": 2}, KnownEmpty(frozenset({"b"}), 0.0))
    order, free = pass_queues(["a", "b"], None, {"a": 1, "b": 1}, known, PROBED_EMPTY_FOR + 1)
    assert order == ("a", "b")
    assert free == {"a": 1, "b": 1}


def test_the_bound_is_within_the_pickup_target() -> None:
    # The late-queue pickup target is stock's wait (~12-20 ms p50 at prefork -c2) + 2 ms; the mean
    # wait for a probe is half the bound.
    assert PROBED_EMPTY_FOR / 2 <= 0.012
