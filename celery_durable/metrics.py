"""The durable-run counter ``jobs_total{queue,outcome}``, on celery_durable's explicit registry.

Where it lives: the counter counts in the process that ran the task. With
``durable_execution = "threads"`` (or ``-P solo``/threads) that is the worker
process, and the worker's ``durable_metrics_port`` endpoint serves it beside
``job_worker_in_flight``. Under prefork each pool child counts its own runs in
its own memory; the parent's endpoint does not see them (use thread execution
when the counter matters, until a multiprocess collector lands).
"""

from __future__ import annotations

from prometheus_client import Counter

# The registry the worker already serves: one endpoint for every celery_durable metric.
from .worker.metrics_gauges import REGISTRY

OUTCOMES = ("succeeded", "failed", "dead_lettered", "cancelled", "duplicate")

JOBS_TOTAL = Counter(
    "jobs", "Durable run attempts by how they ended.", ["queue", "outcome"], registry=REGISTRY,
)


def count(queue: str | None, outcome: str) -> None:
    JOBS_TOTAL.labels(queue=queue or "", outcome=outcome).inc()


def value(queue: str | None, outcome: str) -> float:
    """The counter's current value in this process (tests, and the CLI)."""
    sample = REGISTRY.get_sample_value("jobs_total", {"queue": queue or "", "outcome": outcome})
    return float(sample or 0.0)
