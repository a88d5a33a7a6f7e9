"""The scaler's gauges: ``job_worker_in_flight`` and ``job_worker_capacity``, summed over live workers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily

from celery_durable.config import DurableConfig
from celery_durable.metrics.registry import REGISTRY, serve


class LiveWorker(Protocol):
    """What the gauges read from a running ``-P durable`` worker at scrape time."""

    def in_flight(self) -> int: ...

    def capacity(self) -> int: ...


# Strong references, dropped by unregister_worker when the worker stops: a
# weak set kept a stopped worker counted until the garbage collector ran.
_live_workers: list[LiveWorker] = []
_lock = threading.Lock()


class _WorkerCollector:
    """Reads each live worker at scrape time; a stopped one has unregistered and drops out."""

    def collect(self) -> Iterator[Any]:
        in_flight = GaugeMetricFamily(
            "job_worker_in_flight", "Runs held by live -P durable workers in this process (sum)."
        )
        capacity = GaugeMetricFamily(
            "job_worker_capacity", "Runs live -P durable workers in this process can hold (sum)."
        )
        with _lock:
            workers = list(_live_workers)
        in_flight.add_metric([], sum(w.in_flight() for w in workers))
        capacity.add_metric([], sum(w.capacity() for w in workers))
        yield in_flight
        yield capacity


REGISTRY.register(_WorkerCollector())


def register_worker(worker: LiveWorker, config: DurableConfig) -> None:
    """Count ``worker`` in the gauges until :func:`unregister_worker`; serve the endpoint if configured."""
    with _lock:
        if worker not in _live_workers:
            _live_workers.append(worker)
    if config.metrics_port is not None:
        # A real worker bound at boot (worker_init): this logs where, now that logging is set up.
        serve(config.metrics_host, config.metrics_port)


def unregister_worker(worker: LiveWorker) -> None:
    with _lock:
        if worker in _live_workers:
            _live_workers.remove(worker)
