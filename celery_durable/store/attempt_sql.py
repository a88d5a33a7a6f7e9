"""The SQL that starts an attempt of a run: take its lease, and on PostgreSQL read its checkpoints in the same
round trip.

Kept apart from ``runs.py`` (the statements' callers) so the text is written
once and shared by the one-statement form and the PostgreSQL one-round-trip form.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_durable.store.driver_sql import in_autocommit
from celery_durable.store.schema import RUNNING, SETTLED, runs, steps


def begin_attempt_sql() -> str:
    """The statement that takes a run's lease for a starting attempt, without its RETURNING clause.

    Written out once rather than built per call: SQLAlchemy cannot cache an
    ON CONFLICT construct ("no key"), and recompiling it cost ~1 ms per run.
    The same text is valid on PostgreSQL and on SQLite (>= 3.35, RETURNING).
    In DO UPDATE, the table's own name reads the row as it was. Its binds:
    ``id task_name queue args kwargs at token expires resume retries``.
    """
    t = runs.name
    settled = ", ".join(f"'{state}'" for state in sorted(SETTLED))
    lost = (f"CASE WHEN {t}.state = '{RUNNING}' AND {t}.lease_holder IS NOT NULL "
            f"AND {t}.lease_holder <> COALESCE(:resume, '') THEN 1 ELSE 0 END")
    return (
        f"INSERT INTO {t} (id, task_name, queue, state, attempts, args, kwargs, started_at, updated_at, "
        f"lease_holder, lease_expires_at, lost_attempts, retries) "
        f"VALUES (:id, :task_name, :queue, '{RUNNING}', 1, :args, :kwargs, :at, :at, :token, :expires, 0, "
        f":retries) "
        f"ON CONFLICT (id) DO UPDATE SET state = '{RUNNING}', attempts = {t}.attempts + 1, "
        f"lost_attempts = {t}.lost_attempts + {lost}, retries = :retries, wake_at = NULL, "
        f"lease_holder = :token, lease_expires_at = :expires, updated_at = :at "
        f"WHERE {t}.state NOT IN ({settled}) AND ({t}.lease_holder IS NULL "
        f"OR {t}.lease_holder = :resume "
        f"OR ({t}.state = '{RUNNING}' AND {t}.lease_expires_at <= :at))"
    )


def typed_attempt_binds(clause: sa.TextClause) -> sa.TextClause:
    """``clause`` (which uses :func:`begin_attempt_sql`) with the types its time and token binds need."""
    return clause.bindparams(
        sa.bindparam("at", type_=runs.c.started_at.type),
        sa.bindparam("expires", type_=runs.c.lease_expires_at.type),
        sa.bindparam("resume", type_=runs.c.lease_holder.type),
    )


def attempt_binds(*, run_id: str, task_name: str, queue: str | None, args: str, kwargs: str, token: str,
                  at: datetime, lease_seconds: float, resume: str | None, retries: int) -> dict[str, Any]:
    return {"id": run_id, "task_name": task_name, "queue": queue, "args": args, "kwargs": kwargs, "at": at,
            "token": token, "expires": at + timedelta(seconds=lease_seconds), "resume": resume,
            "retries": retries}


#: Sent first in a start's message on PostgreSQL, on an autocommit connection: the message's implicit
#: transaction commits without waiting for the WAL flush (LOCAL: the session's next statements still wait).
#: What it keeps: a step's checkpoint and the settle still wait for theirs, and a flush writes the WAL up to
#: its own commit, so the first of them makes the start durable too, before any step's result is kept. Only
#: a database crash can forget a start whose flush nothing has waited for yet; the attempt's connection dies
#: with it, so the attempt ends as after any store outage (handed back and started again), and no checkpoint
#: or outcome was written on the start forgotten. A worker's crash forgets nothing (the server flushes within
#: ``wal_writer_delay``), so lost attempts are counted as before. Waiting for the flush was ~0.2 ms of each
#: new run's five commits' ~1.2 ms here.
START_WITHOUT_FLUSH_WAIT = "SET LOCAL synchronous_commit TO off; "


def start_skips_flush_wait(conn: Connection) -> bool:
    """Whether a start on ``conn`` leads with :data:`START_WITHOUT_FLUSH_WAIT`: PostgreSQL, in autocommit (in a
    caller's transaction ``SET LOCAL`` would turn the wait off for the rest of that transaction)."""
    return conn.dialect.name == "postgresql" and in_autocommit(conn)


#: Step columns of the PostgreSQL start: named apart from the run's own columns.
STEP_COLUMNS = (sa.column("step_name", steps.c.name.type), sa.column("step_occurrence", steps.c.occurrence.type),
                sa.column("step_result", steps.c.result.type))


def start_and_load_sql(*, wait_for_flush: bool) -> sa.TextualSelect:
    """PostgreSQL: the attempt's start, then the run's row with its checkpoints, in one round trip.

    Two statements in one message: psycopg2 sends its query with the binds
    already in it (the simple query protocol), and PostgreSQL runs a message's
    statements in one implicit transaction, answering with the last one's rows.
    Not one statement with a CTE: a statement reads the steps in the snapshot
    it started with, but the start may first wait for the row lock of a
    checkpoint in flight (the fence's FOR SHARE, see ``steps.py``) and must
    then see that checkpoint. In READ COMMITTED the second statement takes a
    snapshot of its own, after the first has the lease: it sees every
    checkpoint committed before the takeover, and a later one is fenced out.
    The steps come only with a row this attempt holds (its token is unique):
    a run found settled or live elsewhere comes back as one row, steps NULL.
    ``wait_for_flush=False``: led by :data:`START_WITHOUT_FLUSH_WAIT` (autocommit connections only).
    """
    t, s = runs.name, steps.name
    columns = ", ".join(f"{t}.{c.name}" for c in runs.c)
    return typed_attempt_binds(sa.text(
        f"{'' if wait_for_flush else START_WITHOUT_FLUSH_WAIT}{begin_attempt_sql()}; "
        f"SELECT {columns}, {s}.name AS step_name, {s}.occurrence AS step_occurrence, "
        f"{s}.result AS step_result FROM {t} LEFT JOIN {s} ON {s}.run_id = {t}.id "
        f"AND {t}.lease_holder = :token WHERE {t}.id = :id"
    )).columns(*runs.c, *STEP_COLUMNS)
