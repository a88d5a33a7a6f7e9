"""The outbox relay: publish committed outbox rows in batches, mark them, purge old ones, back off on failure."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa

from . import faults, outbox_metrics
from .planning.outbox import FLAG_AFTER, BatchOutcome, next_wait, settle_batch
from .publishing import publish_batch
from .store import outbox as store
from .store.engine import ensure_schema, resolve_url, store_exists, store_url, unavailable_as_error
from .store.notify import Waker
from .store.runs import render_error

logger = logging.getLogger(__name__)

#: Seconds between purges of published rows older than the retention.
PURGE_EVERY = 60.0


def _now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class PassResult:
    """What one relay pass did."""

    claimed: int
    published: int
    error: str | None = None
    #: Of the published rows: how many went out in broker batches, how many one message at a time.
    batched: int = 0
    one_by_one: int = 0


class Relay:
    """Publishes the outbox of ``app``'s durable store through the app's producer pool.

    ``run()`` loops until ``stop()``: a pass, then a wait cut short by a
    committed row (LISTEN/NOTIFY on PostgreSQL) unless the pass failed.
    ``run_pass()`` is one claim-publish-mark transaction, for tests and tools.
    """

    def __init__(self, app: Any, *, url: str | None = None, batch_size: int = 500,
                 poll_interval: float = 1.0, retention: float = 86400.0, flag_after: int = FLAG_AFTER,
                 listen: bool = True, now: Callable[[], datetime] = _now) -> None:
        self.app = app
        self.url = resolve_url(url) if url is not None else store_url(app)
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.retention = retention
        self.flag_after = flag_after
        self.listen = listen
        self._now = now
        self._stopping = threading.Event()
        self._waker: Waker | None = None
        self._next_purge = 0.0
        #: Consecutive failing passes (broker or database down); 0 after a pass that worked.
        self.failures = 0

    # -- one pass ---------------------------------------------------------------------
    def run_pass(self) -> PassResult:
        """Claim a batch, publish it in id order, mark what went out; a failure stops the batch."""
        if not store_exists(self.url):
            return PassResult(0, 0)
        engine = ensure_schema(self.url)
        now = self._now()
        with unavailable_as_error(self.url), engine.begin() as conn:
            rows = store.claim(conn, self.batch_size, now)
            if not rows:
                return PassResult(0, 0)
            with self.app.producer_or_acquire() as producer:
                published = publish_batch(self.app, producer, rows, self._now)
            if published.sent:
                # Published, nothing marked yet: a crash here republishes these rows.
                faults.reach(faults.RELAY_AFTER_PUBLISH)
            error = published.error
            failed_row = rows[published.sent] if error is not None else None
            outcome = settle_batch([r.id for r in rows], published.sent,
                                   failed_row.attempts if failed_row is not None else None,
                                   flag_after=self.flag_after)
            self._settle(conn, outcome, error, failed_row, now)
        if published.sent:
            outbox_metrics.PUBLISHED.inc(published.sent)
        return PassResult(len(rows), published.sent, render_error(error) if error is not None else None,
                          batched=published.batched, one_by_one=published.one_by_one)

    def _settle(self, conn: Any, outcome: BatchOutcome, error: BaseException | None,
                failed_row: store.OutboxRow | None, now: datetime) -> None:
        store.mark_published(conn, outcome.published, self._now())
        if outcome.failed is None or error is None or failed_row is None:
            return
        rendered = render_error(error)
        store.mark_failed(conn, outcome.failed, attempts=outcome.failed_attempts, error=rendered,
                          retry_at=now + timedelta(seconds=outcome.retry_in))
        outbox_metrics.FAILURES.inc()
        if outcome.failed_attempts >= self.flag_after:
            if outcome.flag:
                outbox_metrics.FLAGGED.inc()
            # Flagged, never dropped: it keeps being retried at the capped backoff.
            logger.error("durable.outbox.flagged task_id=%s task=%s attempts=%s error=%s",
                         failed_row.task_id, failed_row.task_name, outcome.failed_attempts, rendered,
                         extra={"event": "durable.outbox.flagged", "task_id": failed_row.task_id,
                                "attempts": outcome.failed_attempts})
        else:
            logger.warning("durable.outbox.publish_failed task_id=%s attempts=%s error=%s",
                           failed_row.task_id, outcome.failed_attempts, rendered)

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> None:
        outbox_metrics.watch(self.url)
        listen = self.listen and sa.engine.make_url(self.url).get_backend_name() == "postgresql"
        self._waker = waker = Waker(ensure_engine_or_none(self.url) if listen else None)
        logger.info("durable.relay.started url=%s batch_size=%s", _safe(self.url), self.batch_size)
        try:
            while not self._stopping.is_set():
                waker.clear()
                claimed = 0
                try:
                    result = self.run_pass()
                    claimed = result.claimed
                    self.failures = self.failures + 1 if result.error else 0
                    self._maybe_purge()
                except Exception:  # noqa: BLE001 - the store is down: back off, rows stay
                    self.failures += 1
                    logger.warning("durable.relay.pass_failed failures=%s", self.failures, exc_info=True)
                delay = next_wait(claimed=claimed, batch_size=self.batch_size, failures=self.failures,
                                  poll_interval=self.poll_interval)
                if self.failures:
                    # A notification must not cut a backoff short: the broker is still down.
                    self._stopping.wait(delay)
                elif delay > 0:
                    waker.wait(delay)
        finally:
            waker.close()
            self._waker = None
            logger.info("durable.relay.stopped")

    def stop(self) -> None:
        self._stopping.set()
        waker = self._waker
        if waker is not None:
            waker.wake()

    def _maybe_purge(self) -> None:
        if time.monotonic() < self._next_purge:
            return
        self._next_purge = time.monotonic() + min(PURGE_EVERY, self.retention)
        self.purge()

    def purge(self) -> int:
        if not store_exists(self.url):
            return 0
        engine = ensure_schema(self.url)
        with unavailable_as_error(self.url), engine.begin() as conn:
            removed = store.purge_published(conn, self._now() - timedelta(seconds=self.retention))
        if removed:
            logger.info("durable.outbox.purged rows=%s", removed)
        return removed


def ensure_engine_or_none(url: str) -> Any:
    try:
        return ensure_schema(url)
    except Exception:  # noqa: BLE001 - the loop will report the store; wake-ups fall back to polling
        return None


def _safe(url: str) -> str:
    return sa.engine.make_url(url).render_as_string(hide_password=True)
