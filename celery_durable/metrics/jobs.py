"""The durable-run counter ``jobs_total{queue,outcome}``, on celery_durable's explicit registry.

A run is counted in the process that settled it: the pool child that ran it
under prefork, the worker process under threads or solo (and for a revoke,
which Celery announces in the worker process). Each process keeps its own
table; while its worker shares a count directory (``-P durable`` makes one
before its pool forks, see :mod:`celery_durable.metrics.count_files`) it also
writes the table to its file there, and a scrape sums its own table with every
other process's file. So the worker's ``durable_metrics_port`` endpoint shows
the whole worker's counts under prefork, threads and solo alike.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily

from celery_durable import shared_dir
from celery_durable.metrics import count_files

# The registry the worker already serves: one endpoint for every celery_durable metric.
from celery_durable.metrics.registry import REGISTRY


class _ProcessCounts:
    """This process's counts, and the name of the file it shares them in."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        # A forked child starts from zero: the parent's counts are the parent's
        # (it still reports them), and copying them would count them twice.
        self.counts: count_files.Counts = {}
        self.file_name = count_files.file_name()

    def add(self, queue: str, outcome: str) -> None:
        with self.lock:
            key = (queue, outcome)
            self.counts[key] = self.counts.get(key, 0.0) + 1.0
            directory = shared_dir.shared_dir()
            if directory is not None:
                # Under the lock: two threads' writes land in the order they counted.
                count_files.write(directory, self.file_name, self.counts)

    def totals(self) -> count_files.Counts:
        with self.lock:
            own = dict(self.counts)
            name = self.file_name
        directory = shared_dir.shared_dir()
        if directory is None:
            return own
        total = count_files.read_all(directory, skip=name)
        for key, value in own.items():
            total[key] = total.get(key, 0.0) + value
        return total


_counts = _ProcessCounts()
os.register_at_fork(after_in_child=_counts.reset)


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
    _counts.add(queue or "", outcome)


def value(queue: str | None, outcome: str) -> float:
    """The counter's value as the endpoint would show it from this process (tests, and the CLI)."""
    sample = REGISTRY.get_sample_value("jobs_total", {"queue": queue or "", "outcome": outcome})
    return float(sample or 0.0)
