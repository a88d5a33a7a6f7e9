"""The durable-run counter ``jobs_total{queue,outcome}``, on celery_durable's explicit registry.

A run is counted in the process that settled it: the pool child that ran it
under prefork, the worker process under threads or solo (and for a revoke,
which Celery announces in the worker process). Each process keeps its own
table and shares it with the worker's other processes
(:mod:`celery_durable.metrics.process_counts`), so the worker's
``durable_metrics_port`` endpoint shows the whole worker's counts under
prefork, threads and solo alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily

from celery_durable.metrics import count_files
from celery_durable.metrics.process_counts import ProcessCounts

# The registry the worker already serves: one endpoint for every celery_durable metric.
from celery_durable.metrics.registry import REGISTRY

_counts = ProcessCounts(count_files.JOBS_TABLE)


class _JobsCollector:
    """Yields ``jobs_total`` at scrape time from this process and its worker's other processes."""

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily("jobs", "Durable run attempts by how they ended.",
                                     labels=["queue", "outcome"])
        for (queue, outcome), value in sorted(_counts.totals().items()):
            family.add_metric([queue, outcome], value)
        yield family


REGISTRY.register(_JobsCollector())


def count(queue: str | None, outcome: str) -> None:
    _counts.add((queue or "", outcome))


def value(queue: str | None, outcome: str) -> float:
    """The counter's value as the endpoint would show it from this process (tests, and the CLI)."""
    sample = REGISTRY.get_sample_value("jobs_total", {"queue": queue or "", "outcome": outcome})
    return float(sample or 0.0)
