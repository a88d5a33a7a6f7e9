"""Outbox metrics on celery_durable's registry: backlog and oldest-row age read at scrape time, relay counters."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from celery_durable.metrics.registry import REGISTRY
from celery_durable.store import outbox as store
from celery_durable.store.engine import autocommit, ensure_schema, store_exists
from celery_durable.store.unreachable import is_unreachable

logger = logging.getLogger(__name__)

# Labelled by store as the backlog gauges are, so an alert on failures names the outbox that is stuck.
PUBLISHED = Counter("durable_outbox_published", "Outbox rows the relays in this process published.",
                    ["store"], registry=REGISTRY)
FAILURES = Counter("durable_outbox_publish_failures", "Failed publishes of outbox rows (each is retried).",
                   ["store"], registry=REGISTRY)
FLAGGED = Counter("durable_outbox_flagged",
                  "Outbox rows that reached the flag threshold of failed publishes (kept, still retried).",
                  ["store"], registry=REGISTRY)

_urls: set[str] = set()
_lock = threading.Lock()


class _OutboxCollector:
    """Queries each watched store's outbox when scraped; a store that cannot be read is left out."""

    def collect(self) -> Iterator[Any]:
        backlog = GaugeMetricFamily("durable_outbox_backlog", "Unpublished outbox rows.", labels=["store"])
        oldest = GaugeMetricFamily("durable_outbox_oldest_age_seconds",
                                   "Age of the oldest unpublished outbox row (0 when none).", labels=["store"])
        with _lock:
            urls = sorted(_urls)
        for url in urls:
            try:
                count, first = read(url)
            except Exception as err:  # a scrape must not fail because the store is down
                # An outage is told once by the parts that run against the store (store.outage), not
                # at every scrape; any other failure is a bug to see.
                level = logging.DEBUG if is_unreachable(err) else logging.WARNING
                logger.log(level, "durable.metrics.outbox_unreadable", exc_info=True,
                           extra={"event": "durable.metrics.outbox_unreadable"})
                continue
            label = store_label(url)
            backlog.add_metric([label], count)
            oldest.add_metric([label], age_seconds(first, datetime.now(timezone.utc)))
        yield backlog
        yield oldest


def read(url: str) -> tuple[int, datetime | None]:
    if not store_exists(url):
        return 0, None
    with autocommit(ensure_schema(url)).connect() as conn:
        return store.backlog(conn)


def age_seconds(oldest: datetime | None, now: datetime) -> float:
    return max(0.0, (now - oldest).total_seconds()) if oldest is not None else 0.0


def watch(url: str) -> None:
    """Report ``url``'s outbox on the registry (a relay calls this when it starts)."""
    with _lock:
        _urls.add(url)
    label = store_label(url)
    # The counters' series exist at 0 from the relay's start: increase() and rate() cannot see the
    # first failure of a series that appears already at 1.
    for counter in (PUBLISHED, FAILURES, FLAGGED):
        counter.labels(store=label)


def published(url: str, rows: int) -> None:
    PUBLISHED.labels(store=store_label(url)).inc(rows)


def publish_failed(url: str) -> None:
    FAILURES.labels(store=store_label(url)).inc()


def flagged(url: str) -> None:
    FLAGGED.labels(store=store_label(url)).inc()


def store_label(url: str) -> str:
    """The ``store`` label of ``url``'s outbox metrics: backend, host and database, no credentials."""
    parsed = sa.engine.make_url(url)
    return f"{parsed.get_backend_name()}:{parsed.host or ''}/{parsed.database or ''}"


REGISTRY.register(_OutboxCollector())
