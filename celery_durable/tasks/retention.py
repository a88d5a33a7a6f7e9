"""Run retention: settled runs (and their steps) older than ``durable_run_retention`` are deleted.

In small batches, each its own short transaction, so a purge never holds the
runs table for long; one process at a time across the fleet (PostgreSQL: a
transaction-scoped advisory try-lock — a worker finding it taken leaves the
purge to the one that holds it; SQLite: the store's one writer). A running,
sleeping or failed (to be retried) run is never deleted, nor a dead one unless
an operator asks (``celery durable runs purge --include-dead``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta

from celery_durable.clock import SYSTEM_CLOCK, Clock
from celery_durable.store import runs as store_runs
from celery_durable.store.engine import ensure_schema, store_exists, unavailable_as_error
from celery_durable.store.schema import CANCELLED, SUCCEEDED

logger = logging.getLogger("celery_durable.retention")

#: Runs deleted per transaction.
BATCH = 500

#: What the worker's retention deletes: runs that ended and will never run again on their own.
RETAINED_STATES = (SUCCEEDED, CANCELLED)

#: The advisory lock that makes one purge at a time across the fleet (PostgreSQL).
PURGE_LOCK = 7296302


def purge_runs(url: str, older_than: float, states: Sequence[str] = RETAINED_STATES, batch: int = BATCH,
               clock: Clock = SYSTEM_CLOCK) -> int:
    """Delete runs in ``states`` that finished more than ``older_than`` seconds ago (by ``clock``); returns how
    many."""
    if not store_exists(url):
        return 0
    engine = ensure_schema(url)
    before = clock.now() - timedelta(seconds=older_than)
    removed = 0
    while True:
        with unavailable_as_error(url), engine.begin() as conn:
            if conn.dialect.name == "postgresql" and not conn.exec_driver_sql(
                    f"SELECT pg_try_advisory_xact_lock({PURGE_LOCK})").scalar():
                return removed  # another process is purging
            done = store_runs.purge_settled(conn, before, states, batch)
        removed += done
        if done < batch:
            break
    if removed:
        logger.info("durable.runs.purged runs=%s older_than=%ss states=%s", removed, older_than, ",".join(states),
                    extra={"event": "durable.runs.purged", "runs": removed, "older_than": older_than,
                           "states": list(states)})
    return removed
