"""Fleet-limit gauges on celery_durable's registry, read from the durable store at scrape time.

``durable_limit_in_use{task}``: leases held fleet-wide (runs inside a limit),
``durable_limit_waiting{task}``: messages parked waiting for a lease or a rate
turn. One query each per scrape, cached for a second (several scrapers, one read).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from time import monotonic
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.metrics.registry import REGISTRY
from celery_durable.store import limit_waiting
from celery_durable.store import limits as store
from celery_durable.store.engine import autocommit, engine_for
from celery_durable.store.unreachable import is_unreachable

logger = logging.getLogger(__name__)

#: Seconds a read of the store serves scrapes.
CACHE_SECONDS = 1.0

_watched: dict[str, tuple[str, ...]] = {}  # store url -> the limited tasks a worker of this process knows
_lock = threading.Lock()
_cache: dict[str, tuple[float, dict[str, int], dict[str, int]]] = {}


def watch(url: str, tasks: tuple[str, ...]) -> None:
    """Report the limits of ``tasks`` (each shown, 0 when idle) from the store at ``url``."""
    with _lock:
        _watched[url] = tuple(sorted(set(_watched.get(url, ())) | set(tasks)))


def unwatch(url: str) -> None:
    with _lock:
        _watched.pop(url, None)
        _cache.pop(url, None)


def read(url: str) -> tuple[dict[str, int], dict[str, int]]:
    """(leases in use, messages waiting), per task."""
    with _lock:
        cached = _cache.get(url)
    if cached is not None and monotonic() - cached[0] < CACHE_SECONDS:
        return cached[1], cached[2]
    in_use: dict[str, int] = {}
    waiting: dict[str, int] = {}
    with autocommit(engine_for(url)).connect() as conn:
        for task, _kind, _key, count in store.held(conn, SYSTEM_CLOCK.now()):
            in_use[task] = in_use.get(task, 0) + count
        for task, _kind, _key, count in limit_waiting.waiting_counts(conn):
            waiting[task] = waiting.get(task, 0) + count
    with _lock:
        _cache[url] = (monotonic(), in_use, waiting)
    return in_use, waiting


class _LimitsCollector:
    def collect(self) -> Iterator[Any]:
        in_use_family = GaugeMetricFamily("durable_limit_in_use", "Fleet-limit leases held (runs inside a limit).",
                                          labels=["task"])
        waiting_family = GaugeMetricFamily("durable_limit_waiting",
                                           "Messages parked waiting for a fleet-limit lease or rate turn.",
                                           labels=["task"])
        with _lock:
            watched = dict(_watched)
        for url, tasks in watched.items():
            try:
                in_use, waiting = read(url)
            except Exception as err:  # a scrape must not fail because the store is down
                # An outage is told once by the parts that run against the store (store.outage), not
                # at every scrape; any other failure is a bug to see.
                level = logging.DEBUG if is_unreachable(err) else logging.WARNING
                logger.log(level, "durable.metrics.limits_unreadable", exc_info=True,
                           extra={"event": "durable.metrics.limits_unreadable"})
                continue
            for task in sorted(set(tasks) | set(in_use) | set(waiting)):
                in_use_family.add_metric([task], in_use.get(task, 0))
                waiting_family.add_metric([task], waiting.get(task, 0))
        yield in_use_family
        yield waiting_family


REGISTRY.register(_LimitsCollector())
