"""Per-task series: the keys a task's outcome is counted under, and the bounded series a scrape shows.

Pure: the pool process that ran a task counts raw keys (the task's own name);
the process that serves the scrape folds them, here, into at most
``durable_metrics_task_names_limit`` names. A name is admitted the first
scrape it is seen in while there is room and stays admitted; every name seen
once the limit is reached is shown as ``other``. So no series ever moves
from one label value to another, and every counter only goes up.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: The outcomes counted, each its own counter (``celery_task_<outcome>_total``).
OUTCOMES = ("succeeded", "failed", "retried", "revoked")
#: A key's kind for the runtime histogram: one count per bucket, and the sum of runtimes.
RUNTIME, RUNTIME_SUM = "runtime", "runtime_sum"
#: The name every task past the limit is shown under.
OTHER = "other"
#: Upper bounds (seconds) of the runtime buckets, +Inf last: Prometheus' default buckets.
RUNTIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, math.inf)

#: (kind, task name, hostname, queue, detail): detail is the exception class of a failure,
#: the bucket index of a runtime, "" otherwise.
Key = tuple[str, str, str, str, str]
#: The labels of one task's series: (name, hostname, queue).
Labels = tuple[str, str, str]


def outcome_key(outcome: str, labels: Labels, exception: str = "") -> Key:
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
    return (outcome, *labels, exception if outcome == "failed" else "")


def runtime_keys(labels: Labels, seconds: float) -> list[tuple[Key, float]]:
    """What one observed runtime adds: one to its bucket (non-cumulative here), the seconds to the sum."""
    bucket = bisect.bisect_left(RUNTIME_BUCKETS, seconds)
    return [((RUNTIME, *labels, str(bucket)), 1.0), ((RUNTIME_SUM, *labels, ""), max(seconds, 0.0))]


def admit(admitted: tuple[str, ...], limit: int, seen: Iterable[str]) -> tuple[str, ...]:
    """``admitted`` and, while fewer than ``limit``, the new names of ``seen`` (sorted: the same input, the same
    choice)."""
    known = set(admitted)
    room = limit - len(admitted)
    new = sorted({name for name in seen if name not in known})[:max(room, 0)]
    return admitted + tuple(new)


@dataclass(frozen=True)
class Histogram:
    #: Cumulative counts, one per bound of RUNTIME_BUCKETS.
    buckets: tuple[float, ...]
    total: float


@dataclass(frozen=True)
class TaskSeries:
    """What a scrape shows: per outcome, (name, hostname, queue, exception) -> count; per labels, a histogram."""

    counts: Mapping[str, Mapping[tuple[str, str, str, str], float]]
    runtimes: Mapping[Labels, Histogram]


def fold(totals: Mapping[tuple[str, ...], float], admitted: Iterable[str]) -> TaskSeries:
    """The series of ``totals`` (raw keys summed over the worker's processes), names not admitted as OTHER.

    Every label set seen gets a sample in every outcome's counter (0 when none),
    as celery-exporter does, so a ratio of two of them has both sides.
    """
    names = set(admitted)
    counts: dict[str, dict[tuple[str, str, str, str], float]] = {outcome: {} for outcome in OUTCOMES}
    buckets: dict[Labels, list[float]] = {}
    sums: dict[Labels, float] = {}
    for key, value in totals.items():
        if len(key) != 5:
            continue  # a file from another version of the table: not ours to read
        kind, name, hostname, queue, detail = key
        labels = (name if name in names else OTHER, hostname, queue)
        if kind in counts:
            series, counted = counts[kind], (labels[0], labels[1], labels[2], detail)
            series[counted] = series.get(counted, 0.0) + value
        elif kind == RUNTIME and detail.isdigit() and int(detail) < len(RUNTIME_BUCKETS):
            per_bucket = buckets.setdefault(labels, [0.0] * len(RUNTIME_BUCKETS))
            per_bucket[int(detail)] += value
        elif kind == RUNTIME_SUM:
            sums[labels] = sums.get(labels, 0.0) + value
    seen = {series[:3] for by_labels in counts.values() for series in by_labels}
    for by_labels in counts.values():
        with_samples = {series[:3] for series in by_labels}
        for labels in seen - with_samples:
            by_labels[(labels[0], labels[1], labels[2], "")] = 0.0
    runtimes = {labels: Histogram(_cumulative(per_bucket), sums.get(labels, 0.0))
                for labels, per_bucket in buckets.items()}
    return TaskSeries(counts, runtimes)


def names_in(totals: Iterable[tuple[str, ...]]) -> set[str]:
    return {key[1] for key in totals if len(key) == 5}


def _cumulative(per_bucket: list[float]) -> tuple[float, ...]:
    running, out = 0.0, []
    for count in per_bucket:
        running += count
        out.append(running)
    return tuple(out)
