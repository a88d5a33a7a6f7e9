"""The queue gauges, read when scraped: ready messages, the oldest one's age, dead runs, per consumed queue.

``job_queue_depth{queue}`` and ``job_queue_oldest_ready_seconds{queue}`` come
from the broker (``compat/queue_probe.py``: one round trip per queue), the age
from the ``durable_sent_at`` header every app with celery_durable installed
stamps on what it sends (``tasks/sent_stamp.py``) — on the broker that claims
rows, from the rows themselves; a queue whose next message carries no stamp
(sent by an app without it), or whose head the broker does not show, has no
age sample. ``job_queue_dead_runs{queue}`` counts dead
durable runs in the store (one query for all queues). Each live worker's
readings are kept for a second: a scrape every second costs the broker and
the store no more than that, however many scrapers there are.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from time import monotonic, time
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from celery_durable.compat.queue_probe import QueueProbe, probe
from celery_durable.metrics.registry import REGISTRY
from celery_durable.planning.queue_age import oldest_ready_seconds
from celery_durable.store import run_reads
from celery_durable.store.engine import autocommit, engine_for, store_exists
from celery_durable.store.unreachable import is_unreachable

logger = logging.getLogger(__name__)

#: Seconds a watch's readings are reused for.
CACHE_SECONDS = 1.0


@dataclass
class Readings:
    probes: dict[str, QueueProbe | None]
    dead: dict[str, int] | None
    at: float


@dataclass
class QueueWatch:
    """One live worker's queues: the broker connection it reads them on, and its last readings."""

    app: Any
    queues: Callable[[], Sequence[Any]]
    store_url: str | None
    _connection: Any = None
    _channel: Any = None
    _readings: Readings | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self) -> Readings:
        with self._lock:
            if self._readings is not None and monotonic() - self._readings.at < CACHE_SECONDS:
                return self._readings
            self._readings = Readings(self._probe_all(), self._dead(), monotonic())
            return self._readings

    def _probe_all(self) -> dict[str, QueueProbe | None]:
        out: dict[str, QueueProbe | None] = {}
        for queue in self.queues():
            try:
                out[queue.name] = probe(self._open_channel(), queue)
            except Exception:  # a scrape must not fail because the broker is away
                logger.warning("durable.metrics.queue_unreadable queue=%s", queue.name, exc_info=True,
                               extra={"event": "durable.metrics.queue_unreadable", "queue": queue.name})
                self._reset()  # a channel an error closed (AMQP) is opened again at the next read
        return out

    def _dead(self) -> dict[str, int] | None:
        if self.store_url is None or not store_exists(self.store_url):
            return {}
        try:
            with autocommit(engine_for(self.store_url)).connect() as conn:
                return run_reads.dead_by_queue(conn)
        except Exception as err:  # the store is down: no dead-run sample this scrape
            # An outage is told once by the parts that run against the store, not at every scrape.
            level = logging.DEBUG if is_unreachable(err) else logging.WARNING
            logger.log(level, "durable.metrics.dead_runs_unreadable", exc_info=True,
                       extra={"event": "durable.metrics.dead_runs_unreadable"})
            return None

    def _open_channel(self) -> Any:
        if self._channel is not None and not getattr(self._channel, "is_open", True):
            self._reset()  # RabbitMQ closes a channel that asked for a queue it does not have
        if self._channel is None:
            self._connection = self.app.connection_for_read()
            self._channel = self._connection.channel()
        return self._channel

    def _reset(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            try:
                connection.close()
            except Exception:  # closing a broken connection on the way to a new one
                logger.debug("durable.metrics.queue_connection_close_failed", exc_info=True,
                             extra={"event": "durable.metrics.queue_connection_close_failed"})

    def close(self) -> None:
        with self._lock:
            self._reset()


_watches: list[QueueWatch] = []
_lock = threading.Lock()


def watch(app: Any, queues: Callable[[], Sequence[Any]], store_url: str | None) -> QueueWatch:
    """Report the queues ``queues()`` names (read at each scrape: added and cancelled queues follow)."""
    queue_watch = QueueWatch(app, queues, store_url)
    with _lock:
        _watches.append(queue_watch)
    return queue_watch


def unwatch(queue_watch: QueueWatch) -> None:
    with _lock:
        if queue_watch in _watches:
            _watches.remove(queue_watch)
    queue_watch.close()


class _QueueCollector:
    def collect(self) -> Iterator[Any]:
        depth = GaugeMetricFamily("job_queue_depth", "Messages ready in the broker, per queue.", labels=["queue"])
        age = GaugeMetricFamily("job_queue_oldest_ready_seconds",
                                "Seconds since the oldest ready message of the queue was sent (0 when empty).",
                                labels=["queue"])
        dead = GaugeMetricFamily("job_queue_dead_runs", "Dead durable runs claimed from the queue.",
                                 labels=["queue"])
        with _lock:
            watches = list(_watches)
        seen: set[str] = set()
        now = time()
        for queue_watch in watches:
            readings = queue_watch.read()
            for name, probed in sorted(readings.probes.items()):
                if name in seen:
                    continue  # two workers of this process on one queue: one sample
                seen.add(name)
                if probed is not None:
                    depth.add_metric([name], probed.depth)
                    oldest = oldest_ready_seconds(probed.depth, probed.heads, now, probed.ready_for)
                    if oldest is not None:
                        age.add_metric([name], oldest)
                if readings.dead is not None:
                    dead.add_metric([name], readings.dead.get(name, 0))
        yield depth
        yield age
        yield dead


REGISTRY.register(_QueueCollector())
