"""The scaler's gauges: ``job_worker_in_flight`` and ``job_worker_capacity``, summed over live workers."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily

logger = logging.getLogger(__name__)

#: The registry celery_durable serves; a user may also register it elsewhere.
REGISTRY = CollectorRegistry(auto_describe=True)

_live_workers: weakref.WeakSet[Any] = weakref.WeakSet()
_server_lock = threading.Lock()
_served_on: tuple[str, int] | None = None


class _WorkerCollector:
    """Reads each live durable consumer at scrape time; a stopped one drops out."""

    def collect(self) -> Any:
        in_flight = GaugeMetricFamily(
            "job_worker_in_flight", "Runs held by live -P durable workers in this process (sum)."
        )
        capacity = GaugeMetricFamily(
            "job_worker_capacity", "Runs live -P durable workers in this process can hold (sum)."
        )
        workers = [w for w in list(_live_workers) if getattr(w, "durable_live", True)]
        in_flight.add_metric([], sum(w.held.held() for w in workers))
        capacity.add_metric([], sum(w.durable_capacity for w in workers))
        yield in_flight
        yield capacity


REGISTRY.register(_WorkerCollector())


def register_worker(consumer: Any) -> None:
    _live_workers.add(consumer)
    config = consumer.durable_config
    if config.metrics_port is not None:
        serve(config.metrics_host, config.metrics_port)


def unregister_worker(consumer: Any) -> None:
    _live_workers.discard(consumer)


def serve(host: str, port: int) -> None:
    """Serve REGISTRY on host:port once per process."""
    global _served_on
    with _server_lock:
        if _served_on is not None:
            return
        start_http_server(port, addr=host, registry=REGISTRY)
        _served_on = (host, port)
        logger.info("durable.metrics.serving host=%s port=%s", host, port)
