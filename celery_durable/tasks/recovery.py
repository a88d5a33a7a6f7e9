"""Stranded runs: a durable run whose message is gone is sent again by the fleet, one process at a time.

A run left ``running`` under a lease that lapsed, that no delivery took over
within one more lease TTL, has no message anywhere that will (a broker
restarted without persistence, a purged queue, an operator who deleted it):
a live holder renews its lease, and a dead holder's message is back within a
TTL (RabbitMQ at once, Redis by liveness, compat/redis_holders.py). So is a
``sleeping`` run whose wake-up is a TTL overdue. Each is handed to a new
message (same id, arguments, queue and retry count; the hand-off token in its
``durable_resume`` header) in the transaction that records the hand-off: a
copy of the old message that turns up after all meets a run held by the new
one, and is deferred, then dropped once the run settles. PostgreSQL: one
process at a time (a transaction-scoped advisory try-lock) and rows another
holds are skipped; SQLite: the store's one writer.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from celery_durable.headers import RESUME_HEADER
from celery_durable.leases.keeper import new_token
from celery_durable.metrics import jobs
from celery_durable.store import runs as store_runs
from celery_durable.store.clock import store_now
from celery_durable.store.engine import engine_for, store_exists, unavailable_as_error
from celery_durable.store.runs import Run
from celery_durable.store.schema import SLEEPING
from celery_durable.tasks.runs import send

logger = logging.getLogger("celery_durable.run")

#: Runs sent again per transaction.
BATCH = 100

#: The advisory lock that makes one recovery sweep at a time across the fleet (PostgreSQL).
RECOVERY_LOCK = 7296303


def touch(url: str) -> None:
    """Reach the store (``SELECT 1``); raises StoreUnavailable when it does not answer."""
    if not store_exists(url):
        return
    with unavailable_as_error(url), engine_for(url).connect() as conn:
        conn.exec_driver_sql("SELECT 1")


#: Lease TTLs a run handed to a message waits for it before another copy is sent: under a backlog the
#: first copy may be minutes away, and each copy sent is one more message to drain.
RESEND_AFTER_TTLS = 10


def stranded_before(now: datetime, lease_ttl: float) -> datetime:
    """A lease that lapsed (or a wake-up due) before this was given a TTL for a delivery to take it over."""
    return now - timedelta(seconds=lease_ttl)


def resend_before(now: datetime, lease_ttl: float) -> datetime:
    """A run handed to a message before this has waited long enough for it to send another copy."""
    return now - timedelta(seconds=lease_ttl * RESEND_AFTER_TTLS)


def recover_stranded(app: Any, url: str, lease_ttl: float) -> list[Run]:
    """Send every stranded run again (in batches); returns the runs sent."""
    if not store_exists(url):
        return []
    recovered: list[Run] = []
    while True:
        batch = _recover_batch(app, url, lease_ttl)
        recovered += batch
        for run in batch:
            jobs.count(run.queue, "recovered")
            logger.warning("durable.run.recovered id=%s task=%s state=%s: no delivery took it over within a "
                           "lease TTL of its %s; sent again from its last checkpoint", run.id, run.task_name,
                           run.state, "wake-up" if run.state == SLEEPING else "lapsed lease",
                           extra={"event": "durable.run.recovered", "run_id": run.id, "task": run.task_name,
                                  "state": run.state})
        if len(batch) < BATCH:
            return recovered


def _recover_batch(app: Any, url: str, lease_ttl: float) -> list[Run]:
    with unavailable_as_error(url), engine_for(url).begin() as conn:
        if conn.dialect.name == "postgresql" and not conn.exec_driver_sql(
                f"SELECT pg_try_advisory_xact_lock({RECOVERY_LOCK})").scalar():
            return []  # another process is sweeping
        sent: list[Run] = []
        # Lease expiries are in the store's clock: so is the bound they are compared with.
        now = store_now(conn)
        before = stranded_before(now, lease_ttl)
        for run in store_runs.stranded(conn, before, resend_before(now, lease_ttl), BATCH):
            token = store_runs.hand_off_to_resend(conn, run, new_token(), now)
            if token is None:
                continue
            # Inside the transaction that holds the row: a worker that gets the message at once waits
            # for the hand-off to commit, and a failed publish leaves the run as it was.
            send(app, run, retries=run.retries, headers={RESUME_HEADER: token})
            sent.append(run)
        return sent
