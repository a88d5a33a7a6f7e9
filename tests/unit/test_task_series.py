"""Per-task series from tables: the keys an outcome is counted under, name folding past the limit, histograms."""

from __future__ import annotations

import math

import pytest

from celery_durable.planning.task_series import (
    OTHER,
    RUNTIME_BUCKETS,
    admit,
    fold,
    names_in,
    outcome_key,
    runtime_keys,
)

A = ("app.a", "w1@h", "celery")
B = ("app.b", "w1@h", "celery")


@pytest.mark.parametrize(
    "admitted, limit, seen, expected",
    [
        pytest.param((), 3, ["b", "a"], ("a", "b"), id="room-for-all-sorted"),
        pytest.param((), 2, ["c", "b", "a"], ("a", "b"), id="first-sorted-past-the-limit"),
        pytest.param(("z",), 2, ["a", "b", "z"], ("z", "a"), id="admitted-stay-first"),
        pytest.param(("z", "y"), 2, ["a"], ("z", "y"), id="full-admits-none"),
        pytest.param(("z", "y"), 1, ["a"], ("z", "y"), id="limit-lowered-keeps-admitted"),
        pytest.param(("a",), 5, ["a", "a"], ("a",), id="seen-again-not-twice"),
    ],
)
def test_admit(admitted, limit, seen, expected):
    assert admit(admitted, limit, seen) == expected


@pytest.mark.parametrize(
    "seconds, bucket",
    [
        pytest.param(0.0, 0, id="zero"),
        pytest.param(0.005, 0, id="on-a-bound-is-in-it"),
        pytest.param(0.0051, 1, id="just-past"),
        pytest.param(0.3, 7, id="in-the-middle"),
        pytest.param(10.0, 13, id="last-finite"),
        pytest.param(3600.0, 14, id="inf"),
    ],
)
def test_a_runtime_lands_in_the_first_bucket_that_holds_it(seconds, bucket):
    (bucket_key, one), (sum_key, total) = runtime_keys(A, seconds)
    assert bucket_key == ("runtime", *A, str(bucket)) and one == 1.0
    assert sum_key == ("runtime_sum", *A, "") and total == seconds
    assert seconds <= RUNTIME_BUCKETS[bucket]


def test_only_a_failure_keeps_its_exception_and_an_unknown_outcome_is_refused():
    assert outcome_key("failed", A, "ValueError") == ("failed", *A, "ValueError")
    assert outcome_key("retried", A, "ValueError") == ("retried", *A, "")
    with pytest.raises(ValueError, match="outcome"):
        outcome_key("lost", A)


def test_fold_sums_names_past_the_limit_into_other_and_fills_every_outcome():
    totals = {
        outcome_key("succeeded", A): 3.0,
        outcome_key("succeeded", B): 2.0,
        outcome_key("failed", B, "KeyError"): 1.0,
        ("succeeded", "app.c", "w1@h", "celery", ""): 4.0,
        ("stale", "row"): 9.0,  # another table's row: skipped
        **dict(runtime_keys(A, 0.3)),
    }
    series = fold(totals, admitted=("app.a",))
    other = (OTHER, "w1@h", "celery")
    assert series.counts["succeeded"] == {(*A, ""): 3.0, (*other, ""): 6.0}
    assert series.counts["failed"] == {(*other, "KeyError"): 1.0, (*A, ""): 0.0}
    assert series.counts["retried"] == {(*A, ""): 0.0, (*other, ""): 0.0}
    assert series.counts["revoked"] == {(*A, ""): 0.0, (*other, ""): 0.0}
    histogram = series.runtimes[A]
    assert histogram.total == pytest.approx(0.3)
    assert histogram.buckets == (0.0,) * 7 + (1.0,) * 8
    assert names_in(totals) == {"app.a", "app.b", "app.c"}


def test_histogram_buckets_are_cumulative_and_end_at_the_count():
    totals: dict[tuple[str, ...], float] = {}
    for seconds in (0.001, 0.2, 0.2, 7.0, math.inf):
        for key, amount in runtime_keys(A, seconds):
            totals[key] = totals.get(key, 0.0) + amount
    buckets = fold(totals, admitted=("app.a",)).runtimes[A].buckets
    assert list(buckets) == sorted(buckets)
    assert buckets[0] == 1 and buckets[6] == 3 and buckets[12] == 4 and buckets[-1] == 5
