"""Every task a ``-P durable`` worker runs: ``celery_task_<outcome>_total`` and ``celery_task_runtime``.

Named as celery-exporter names them (``name``, ``hostname``, ``queue_name``
labels; ``exception`` on failures) so its dashboards and alert rules read
them, but counted in the worker itself: no event stream, no exporter beside
it. A task is counted in the process its outcome is known in (the pool child
for one that returned or raised, the worker process for a revoke, a hard time
limit or a lost child) and summed over the worker's processes at scrape time
(:mod:`celery_durable.metrics.process_counts`), where its name is folded into
at most ``durable_metrics_task_names_limit`` names (:mod:`celery_durable.planning.task_series`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from celery_durable.config import DEFAULT_TASK_NAMES_LIMIT
from celery_durable.metrics.process_counts import ProcessCounts
from celery_durable.metrics.registry import REGISTRY
from celery_durable.planning import task_series
from celery_durable.planning.task_series import OUTCOMES, RUNTIME_BUCKETS, Labels

_TABLE = "tasks"
_counts = ProcessCounts(_TABLE)

_HELP = {
    "succeeded": "Tasks this worker ran that returned.",
    "failed": "Tasks this worker ran that failed (raised, hit the hard time limit, or lost their pool child).",
    "retried": "Tasks this worker ran that asked to be retried.",
    "revoked": "Tasks revoked or expired at this worker, before or while they ran.",
}


class _Names:
    """The task names shown as themselves: admitted at the scrape they first appear in, while there is room."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.limit = DEFAULT_TASK_NAMES_LIMIT
        self.admitted: tuple[str, ...] = ()

    def admit(self, seen: set[str]) -> tuple[str, ...]:
        with self.lock:
            self.admitted = task_series.admit(self.admitted, self.limit, seen)
            return self.admitted


_names = _Names()


def set_names_limit(limit: int) -> None:
    """At worker boot, from ``durable_metrics_task_names_limit`` (validated by the config)."""
    with _names.lock:
        _names.limit = limit


class _TasksCollector:
    """Yields the per-task counters and the runtime histogram at scrape time."""

    def collect(self) -> Iterator[Any]:
        totals = _counts.totals()
        series = task_series.fold(totals, _names.admit(task_series.names_in(totals)))
        for outcome in OUTCOMES:
            labels = ["name", "hostname", "queue_name"] + (["exception"] if outcome == "failed" else [])
            family = CounterMetricFamily(f"celery_task_{outcome}", _HELP[outcome], labels=labels)
            for (name, hostname, queue, exception), value in sorted(series.counts[outcome].items()):
                values = [name, hostname, queue] + ([exception] if outcome == "failed" else [])
                family.add_metric(values, value)
            yield family
        runtime = HistogramMetricFamily("celery_task_runtime", "Seconds tasks that succeeded ran for.",
                                        labels=["name", "hostname", "queue_name"])
        for (name, hostname, queue), histogram in sorted(series.runtimes.items()):
            buckets = [(_bound(bound), count) for bound, count in zip(RUNTIME_BUCKETS, histogram.buckets)]
            runtime.add_metric([name, hostname, queue], buckets, histogram.total)
        yield runtime


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


REGISTRY.register(_TasksCollector())


def count(outcome: str, labels: Labels, *, exception: str = "") -> None:
    _counts.add(task_series.outcome_key(outcome, labels, exception))


def succeeded(labels: Labels, runtime: float) -> None:
    """A success and its runtime, in one write of this process's count file."""
    _counts.add_all([(task_series.outcome_key("succeeded", labels), 1.0), *task_series.runtime_keys(labels, runtime)])
