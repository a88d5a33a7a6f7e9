"""The outbox relay: publish committed outbox rows in batches, mark them, purge old ones, back off on failure."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from celery_durable.clock import SYSTEM_CLOCK, Clock
from celery_durable.faults import NO_FAULTS, RELAY_AFTER_PUBLISH, FaultPoints
from celery_durable.metrics import outbox as outbox_metrics
from celery_durable.outbox.publishing import publish_batch
from celery_durable.outbox.relay_probe import broker_problem, store_problem
from celery_durable.planning.outbox import (
    BACKOFF_JITTER,
    FLAG_AFTER,
    PROBE_EVERY,
    BatchOutcome,
    next_wait,
    probe_after,
    settle_batch,
)
from celery_durable.store import outage
from celery_durable.store import outbox as store
from celery_durable.store.engine import (
    ensure_schema,
    resolve_url,
    store_exists,
    store_url,
    unavailable_as_error,
)
from celery_durable.store.notify import Waker
from celery_durable.store.runs import render_error
from celery_durable.store.urls import shown_url
from celery_durable.tasks.retention import purge_runs

logger = logging.getLogger(__name__)

#: Seconds between purges of published rows older than the retention.
PURGE_EVERY = 60.0


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
    committed row (LISTEN/NOTIFY on PostgreSQL). After a failing pass the wait
    is a jittered backoff instead, during which the store and the broker are
    probed every ``probe_every`` seconds: once a probe has found them down, the
    first probe that finds both back ends the backoff (see ``_back_off``).
    ``run_pass()`` is one claim-publish-mark transaction, for tests and tools.
    """

    def __init__(self, app: Any, *, url: str | None = None, batch_size: int = 500,
                 poll_interval: float = 1.0, retention: float = 86400.0, run_retention: float = 0.0,
                 flag_after: int = FLAG_AFTER,
                 listen: bool = True, clock: Clock = SYSTEM_CLOCK,
                 probe_every: float = PROBE_EVERY, jitter: float = BACKOFF_JITTER,
                 draw: Callable[[], float] = random.random, faults: FaultPoints = NO_FAULTS) -> None:
        self.app = app
        self.url = resolve_url(url) if url is not None else store_url(app)
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.retention = retention
        #: Seconds settled durable runs are kept (0: not purged here; see ``tasks.retention``).
        self.run_retention = run_retention
        self.flag_after = flag_after
        self.listen = listen
        self._clock = clock
        self.probe_every = probe_every
        self.jitter = jitter
        self._draw = draw
        self._faults = faults
        self._stopping = threading.Event()
        self._waker: Waker | None = None
        self._next_purge = 0.0
        #: Consecutive failing passes (broker or database down); 0 after a pass that worked.
        self.failures = 0
        #: A probe found the store or broker down since the last pass that worked.
        self._seen_down = False
        #: Rows whose publish failed since the last pass that worked (their ids).
        self._failed_rows: set[int] = set()
        #: Backoffs a probe ended early (the store or broker came back); for tests and logs.
        self.recoveries = 0

    # -- one pass ---------------------------------------------------------------------
    def run_pass(self) -> PassResult:
        """Claim a batch, publish it in id order, mark what went out; a failure stops the batch."""
        if not store_exists(self.url):
            return PassResult(0, 0)
        engine = ensure_schema(self.url)
        now = self._clock.now()
        with unavailable_as_error(self.url), engine.begin() as conn:
            rows = store.claim(conn, self.batch_size, now)
            if not rows:
                return PassResult(0, 0)
            try:
                with self.app.producer_or_acquire() as producer:
                    published = publish_batch(self.app, producer, rows, self._clock)
            except Exception:
                # No connection to the broker (the batch records the failures it meets itself): the
                # claim rolls back with no attempt marked, but an alert on publish failures must see it.
                outbox_metrics.publish_failed(self.url)
                raise
            if published.sent:
                # Published, nothing marked yet: a crash here republishes these rows.
                self._faults.reach(RELAY_AFTER_PUBLISH)
            error = published.error
            failed_row = rows[published.sent] if error is not None else None
            outcome = settle_batch([r.id for r in rows], published.sent,
                                   failed_row.attempts if failed_row is not None else None,
                                   flag_after=self.flag_after, jitter=self.jitter, draw=self._draw())
            self._settle(conn, outcome, error, failed_row, now)
        if published.sent:
            outbox_metrics.published(self.url, published.sent)
        return PassResult(len(rows), published.sent, render_error(error) if error is not None else None,
                          batched=published.batched, one_by_one=published.one_by_one)

    def _settle(self, conn: Any, outcome: BatchOutcome, error: BaseException | None,
                failed_row: store.OutboxRow | None, now: datetime) -> None:
        store.mark_published(conn, outcome.published, self._clock.now())
        if outcome.failed is None or error is None or failed_row is None:
            return
        rendered = render_error(error)
        self._failed_rows.add(outcome.failed)
        store.mark_failed(conn, outcome.failed, attempts=outcome.failed_attempts, error=rendered,
                          retry_at=now + timedelta(seconds=outcome.retry_in))
        outbox_metrics.publish_failed(self.url)
        if outcome.failed_attempts >= self.flag_after:
            if outcome.flag:
                outbox_metrics.flagged(self.url)
            # Flagged, never dropped: it keeps being retried at the capped backoff.
            logger.error("durable.outbox.flagged task_id=%s task=%s attempts=%s error=%s",
                         failed_row.task_id, failed_row.task_name, outcome.failed_attempts, rendered,
                         extra={"event": "durable.outbox.flagged", "task_id": failed_row.task_id,
                                "task": failed_row.task_name, "attempts": outcome.failed_attempts, "error": rendered})
        else:
            logger.warning("durable.outbox.publish_failed task_id=%s attempts=%s error=%s",
                           failed_row.task_id, outcome.failed_attempts, rendered,
                           extra={"event": "durable.outbox.publish_failed", "task_id": failed_row.task_id,
                                  "attempts": outcome.failed_attempts, "error": rendered})

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> None:
        outbox_metrics.watch(self.url)
        listen = self.listen and sa.engine.make_url(self.url).get_backend_name() == "postgresql"
        self._waker = waker = Waker(ensure_engine_or_none(self.url) if listen else None, report=self._listened)
        shown = shown_url(self.url)
        logger.info("durable.relay.started url=%s batch_size=%s", shown, self.batch_size,
                    extra={"event": "durable.relay.started", "store": shown, "batch_size": self.batch_size})
        try:
            while not self._stopping.is_set():
                waker.clear()
                claimed = 0
                try:
                    result = self.run_pass()
                    claimed = result.claimed
                    if result.error:
                        self.failures += 1
                    else:
                        self._worked()
                    self._maybe_purge()
                except Exception as err:  # noqa: BLE001 - the store is down: back off, rows stay
                    self.failures += 1
                    outage.failed(self.url, err, "durable.relay.pass_failed", level=logging.WARNING,
                                  failures=self.failures)
                else:
                    outage.available(self.url)
                delay = next_wait(claimed=claimed, batch_size=self.batch_size, failures=self.failures,
                                  poll_interval=self.poll_interval, jitter=self.jitter, draw=self._draw())
                if self.failures:
                    # A notification must not cut a backoff short (the broker may still be
                    # down); a probe finding the store and broker back does.
                    if self._back_off(delay):
                        self._release_failed_rows()
                elif delay > 0:
                    waker.wait(delay)
        finally:
            waker.close()
            self._waker = None
            logger.info("durable.relay.stopped", extra={"event": "durable.relay.stopped"})

    def _listened(self, err: BaseException | None) -> None:
        if err is None:
            outage.available(self.url)
        else:
            outage.failed(self.url, err, "durable.relay.listen_failed", level=logging.WARNING)

    def _worked(self) -> None:
        self.failures = 0
        self._seen_down = False
        self._failed_rows.clear()

    def _back_off(self, delay: float) -> bool:
        """Wait out a backoff of ``delay`` s, probing; True if a probe ended it because all is back.

        Only a probe after one that found the store or broker down ends it early: a
        failure with both reachable (a row the broker refuses, a bug) keeps the whole
        backoff, so it cannot turn into a pass every probe interval.
        """
        deadline = self._clock.monotonic() + delay
        while not self._stopping.is_set():
            wait = probe_after(deadline - self._clock.monotonic(), probe_every=self.probe_every)
            if wait <= 0 or self._stopping.wait(wait) or self._clock.monotonic() >= deadline:
                # The pass at the end of the backoff is the check now.
                return False
            problem = store_problem(self.url) or broker_problem(self.app)
            if problem is not None:
                self._seen_down = True
                logger.debug("durable.relay.probe_failed problem=%s", problem,
                             extra={"event": "durable.relay.probe_failed", "problem": problem})
            elif self._seen_down:
                self.recoveries += 1
                logger.info("durable.relay.recovered failures=%s", self.failures,
                            extra={"event": "durable.relay.recovered", "failures": self.failures})
                return True
            else:
                # Reachable all along: no point probing until the backoff ends.
                self._stopping.wait(max(0.0, deadline - self._clock.monotonic()))
                return False
        return False

    def _release_failed_rows(self) -> None:
        """Make the rows that failed while the store or broker was down available now.

        Their own backoff (``available_at``) grew with every failed publish during the
        outage; it was about the outage, not about them, so it ends with it. Their
        attempt counts stay (and with them the flagging), and a row failing again is
        deferred again as usual.
        """
        ids, self._failed_rows = sorted(self._failed_rows), set()
        if not ids:
            return
        try:
            with unavailable_as_error(self.url), ensure_schema(self.url).begin() as conn:
                released = store.release(conn, ids, self._clock.now())
        except Exception as err:  # noqa: BLE001 - the next pass reports a store that went down again
            outage.failed(self.url, err, "durable.relay.release_failed", level=logging.WARNING, rows=len(ids))
            return
        if released:
            logger.info("durable.outbox.released rows=%s", released,
                        extra={"event": "durable.outbox.released", "rows": released})

    def stop(self) -> None:
        self._stopping.set()
        waker = self._waker
        if waker is not None:
            waker.wake()

    def _maybe_purge(self) -> None:
        if self._clock.monotonic() < self._next_purge:
            return
        self._next_purge = self._clock.monotonic() + min(PURGE_EVERY, self.retention)
        self.purge()

    def purge(self) -> int:
        if not store_exists(self.url):
            return 0
        engine = ensure_schema(self.url)
        with unavailable_as_error(self.url), engine.begin() as conn:
            removed = store.purge_published(conn, self._clock.now() - timedelta(seconds=self.retention))
        if removed:
            logger.info("durable.outbox.purged rows=%s", removed,
                        extra={"event": "durable.outbox.purged", "rows": removed})
        if self.run_retention:
            # The store's other housekeeping, on the same cadence: settled runs past their retention.
            purge_runs(self.url, self.run_retention, clock=self._clock)
        return removed


def ensure_engine_or_none(url: str) -> Any:
    try:
        return ensure_schema(url)
    except Exception:  # noqa: BLE001 - the loop will report the store; wake-ups fall back to polling
        return None
