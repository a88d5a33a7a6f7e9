"""Outbox planning from tables: option serialisation, batch settlement, backoff, the relay's wait."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from celery_durable.planning.outbox import (
    BACKOFF_CAP,
    FLAG_AFTER,
    OptionInvalid,
    backoff_delay,
    next_wait,
    probe_after,
    serialize_options,
    settle_batch,
)

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize(("options", "expected"), [
    ({"queue": "orders", "countdown": 5}, {"queue": "orders", "eta": (NOW + timedelta(seconds=5)).isoformat()}),
    ({"expires": 60}, {"expires": (NOW + timedelta(seconds=60)).isoformat()}),
    ({"eta": NOW + timedelta(hours=1)}, {"eta": (NOW + timedelta(hours=1)).isoformat()}),
    ({"priority": 9, "headers": {"tenant": "a"}, "routing_key": "rk"},
     {"priority": 9, "headers": {"tenant": "a"}, "routing_key": "rk"}),
    ({"queue": None, "time_limit": 30}, {"time_limit": 30.0}),
])
def test_options_are_stored_as_json_with_absolute_times(options: dict, expected: dict) -> None:
    assert serialize_options(options, NOW) == expected


@pytest.mark.parametrize(("options", "named"), [
    ({"producer": object()}, "producer"),
    ({"countdown": -1}, "countdown"),
    ({"countdown": float("nan")}, "countdown"),
    ({"countdown": 1, "eta": NOW}, "countdown or eta"),
    ({"eta": datetime(2026, 1, 1)}, "timezone-aware"),
    ({"priority": 256}, "priority"),
    ({"priority": True}, "priority"),
    ({"headers": {"x": object()}}, "JSON"),
    ({"queue": ""}, "queue"),
])
def test_options_a_row_cannot_keep_are_refused_by_name(options: dict, named: str) -> None:
    with pytest.raises(OptionInvalid, match=named):
        serialize_options(options, NOW)


@pytest.mark.parametrize(("attempts", "delay"), [
    (0, 0.0), (1, 0.5), (2, 1.0), (3, 2.0), (8, 60.0), (9, BACKOFF_CAP), (10_000, BACKOFF_CAP),
])
def test_backoff_doubles_from_half_a_second_to_the_cap(attempts: int, delay: float) -> None:
    assert backoff_delay(attempts) == delay


@pytest.mark.parametrize(("attempts", "jitter", "draw", "delay"), [
    (3, 0.2, 0.5, 2.0),        # the middle draw: no spread
    (3, 0.2, 0.0, 1.6),        # the lowest draw: jitter below
    (3, 0.2, 1.0, 2.4),        # the highest: jitter above
    (3, 0.2, 0.25, 1.8),
    (1, 0.5, 1.0, 0.75),
    (8, 0.2, 0.0, 48.0),       # at the cap it spreads downwards ...
    (8, 0.2, 1.0, BACKOFF_CAP),  # ... and never above it
    (10_000, 0.2, 0.75, BACKOFF_CAP),
    (0, 0.2, 1.0, 0.0),        # no failure, no wait, whatever the draw
    (3, 0.0, 1.0, 2.0),        # no jitter: the draw is ignored
])
def test_backoff_jitter_spreads_by_the_draw_within_the_cap(attempts: int, jitter: float, draw: float,
                                                           delay: float) -> None:
    assert backoff_delay(attempts, jitter=jitter, draw=draw) == pytest.approx(delay)


@pytest.mark.parametrize(("jitter", "draw"), [(-0.1, 0.5), (1.0, 0.5), (0.2, -0.01), (0.2, 1.01),
                                              (float("nan"), 0.5), (0.2, float("nan"))])
def test_backoff_jitter_and_draw_out_of_range_are_refused(jitter: float, draw: float) -> None:
    with pytest.raises(ValueError):
        backoff_delay(3, jitter=jitter, draw=draw)


@pytest.mark.parametrize(("left", "every", "after"), [
    (32.0, 1.0, 1.0),   # a long backoff is checked every second ...
    (0.5, 1.0, 0.5),    # ... a short one only by the pass at its end
    (1.0, 1.0, 1.0),
    (0.0, 1.0, 0.0),
    (-0.2, 1.0, 0.0),   # overdue: now
    (10.0, 0.25, 0.25),
])
def test_probe_after(left: float, every: float, after: float) -> None:
    assert probe_after(left, probe_every=every) == after


def test_a_failed_rows_retry_is_jittered_by_the_draw() -> None:
    assert settle_batch([4, 5], 0, prior_attempts=2, jitter=0.2, draw=0.0).retry_in == pytest.approx(1.6)
    assert settle_batch([4, 5], 0, prior_attempts=2, jitter=0.2, draw=1.0).retry_in == pytest.approx(2.4)


def test_a_batch_that_published_everything_marks_everything() -> None:
    outcome = settle_batch([4, 5, 6], 3, None)
    assert outcome.published == (4, 5, 6) and outcome.failed is None


def test_a_failure_marks_the_rows_before_it_defers_it_and_leaves_the_rest() -> None:
    outcome = settle_batch([4, 5, 6, 7], 1, prior_attempts=2)
    assert outcome.published == (4,)
    assert (outcome.failed, outcome.failed_attempts, outcome.retry_in) == (5, 3, 2.0)
    assert outcome.untried == (6, 7)
    assert not outcome.flag


@pytest.mark.parametrize(("prior", "flag"), [(FLAG_AFTER - 2, False), (FLAG_AFTER - 1, True), (FLAG_AFTER, False)])
def test_a_row_is_flagged_once_when_it_reaches_the_threshold(prior: int, flag: bool) -> None:
    assert settle_batch([1], 0, prior_attempts=prior).flag is flag


def test_published_count_outside_the_batch_is_a_bug() -> None:
    with pytest.raises(ValueError):
        settle_batch([1, 2], 3, None)


@pytest.mark.parametrize(("claimed", "failures", "wait"), [
    (500, 0, 0.0),   # a full batch: more are waiting
    (10, 0, 1.0),    # caught up: wait for a notification or the poll
    (0, 0, 1.0),
    (500, 3, 2.0),   # failing: back off even with a full batch
])
def test_next_wait(claimed: int, failures: int, wait: float) -> None:
    assert next_wait(claimed=claimed, batch_size=500, failures=failures, poll_interval=1.0) == wait


@pytest.mark.parametrize(("failures", "draw", "wait"), [(3, 0.0, 1.6), (3, 1.0, 2.4), (0, 0.0, 1.0)])
def test_next_wait_jitters_only_a_backoff(failures: int, draw: float, wait: float) -> None:
    assert next_wait(claimed=0, batch_size=500, failures=failures, poll_interval=1.0,
                     jitter=0.2, draw=draw) == pytest.approx(wait)
