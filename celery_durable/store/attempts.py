"""Start an attempt of a run: its lease taken (or the row as found) and its checkpoints, in as few round trips
as the database allows."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.engine import Connection

from celery_durable.planning.checkpoints import StepKey
from celery_durable.store import runs, steps
from celery_durable.store.attempt_sql import STEP_COLUMNS, attempt_binds, start_and_load_sql, start_skips_flush_wait
from celery_durable.store.clock import store_now
from celery_durable.store.runs import Run

#: By start_skips_flush_wait(conn).
_START_AND_LOAD = {True: start_and_load_sql(wait_for_flush=False), False: start_and_load_sql(wait_for_flush=True)}
_STEP_KEYS = tuple(c.name for c in STEP_COLUMNS)


@dataclass(frozen=True)
class Start:
    """What a delivery found: the run, whether this attempt took its lease, and (if it did) its checkpoints."""

    run: Run
    started: bool
    checkpoints: dict[StepKey, str]


def start(conn: Connection, *, run_id: str, task_name: str, queue: str | None, args: str, kwargs: str,
          token: str, lease_seconds: float, resume: str | None = None, retries: int = 0) -> Start:
    """:func:`runs.begin_attempt`, then the checkpoints of a run it started before.

    One round trip on PostgreSQL for a delivery that expects checkpoints: a
    retry (``retries`` > 0) or a hand-off (``resume``: a durable sleep's
    wake-up, a re-send after a store outage). Any other delivery is most often
    a new run, which has no checkpoints and skips the read: its start alone is
    cheaper than the two-statement message (measured ~0.2 ms less a run), and
    the rare one that turns out to be a takeover reads them in a second round
    trip. SQLite runs each statement in-process (no wire to save), and its
    driver takes one statement per call.
    """
    if conn.dialect.name != "postgresql" or (resume is None and retries == 0):
        run, started = runs.begin_attempt(conn, run_id=run_id, task_name=task_name, queue=queue, args=args,
                                          kwargs=kwargs, token=token, lease_seconds=lease_seconds, resume=resume,
                                          retries=retries)
        checkpoints = steps.load(conn, run.id) if started and run.attempts > 1 else {}
        return Start(run, started, checkpoints)
    rows = conn.execute(_START_AND_LOAD[start_skips_flush_wait(conn)], attempt_binds(
        run_id=run_id, task_name=task_name, queue=queue, args=args, kwargs=kwargs, token=token,
        at=store_now(conn), lease_seconds=lease_seconds, resume=resume, retries=retries)).all()
    if not rows:  # deleted between the statements: run it as new next time
        raise RuntimeError(f"run {run_id} vanished while starting")
    fields = rows[0]._mapping
    run = Run(**{name: value for name, value in fields.items() if name not in _STEP_KEYS})
    checkpoints = {StepKey(row.step_name, row.step_occurrence): row.step_result
                   for row in rows if row.step_name is not None}
    return Start(run, run.lease_holder == token, checkpoints)
