"""SQL for step checkpoints: load a run's checkpoints at once, store one in a single INSERT fenced by the lease."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.planning.checkpoints import StepKey
from celery_durable.store.driver_sql import DriverStatement
from celery_durable.store.schema import runs, steps


def _fenced_insert_statement() -> sa.Insert:
    # The checkpoint's row comes from a SELECT of the run's own row, so it is written only while
    # the run names this attempt as its holder: an attempt whose process froze past its lease, and
    # was taken over, records nothing (and a transactional step's transaction rolls back).
    #
    # FOR SHARE (PostgreSQL) closes the race with a takeover. A takeover is an UPDATE of the run's
    # row; without the lock the SELECT would read the holder from its snapshot while the takeover
    # commits, the new attempt would load its checkpoints before this transaction commits, and the
    # step would run (and a transactional one commit) twice. With it: a takeover that committed
    # first leaves a row the fence re-reads and refuses (0 rows); one that comes after waits on the
    # lock until this transaction has committed, and the new attempt's checkpoint read, a later
    # statement, sees the step. Every checkpoint pays a row lock it holds only until its own
    # commit. SQLite compiles no lock clause: one writer at a time, and a write transaction reads
    # the latest commit.
    run_id = sa.bindparam("run_id", type_=steps.c.run_id.type)
    values = sa.select(
        run_id,
        sa.bindparam("name", type_=steps.c.name.type),
        sa.bindparam("occurrence", type_=steps.c.occurrence.type),
        sa.bindparam("result", type_=steps.c.result.type),
        sa.bindparam("created_at", type_=steps.c.created_at.type),
    ).where(runs.c.id == run_id, runs.c.lease_holder == sa.bindparam("token", type_=runs.c.lease_holder.type))
    return sa.insert(steps).from_select(
        ["run_id", "name", "occurrence", "result", "created_at"], values.with_for_update(read=True))


_FENCED_INSERT = _fenced_insert_statement()
_FENCED_INSERT_DRIVER = DriverStatement(_FENCED_INSERT)


def load(conn: Connection, run_id: str) -> dict[StepKey, str]:
    """Every checkpoint of ``run_id``: a replayed step is then a dict lookup, not a query."""
    rows = conn.execute(
        sa.select(steps.c.name, steps.c.occurrence, steps.c.result).where(steps.c.run_id == run_id)
    )
    return {StepKey(name, occurrence): result for name, occurrence, result in rows}


def insert(conn: Connection, run_id: str, key: StepKey, encoded: str, token: str) -> bool:
    """Store one checkpoint if the attempt holding ``token`` still holds the run; False: it does not.

    One statement: on an autocommit connection, one round trip.
    """
    return bool(_FENCED_INSERT_DRIVER.execute(conn, _insert_binds(run_id, key, encoded, token)) == 1)


def insert_in(tx: Connection, run_id: str, key: StepKey, encoded: str, token: str) -> bool:
    """:func:`insert` in the caller's transaction (a transactional step's), through ``Connection.execute``:
    the transaction's ``before_execute`` hooks see it, as they see the step's own statements."""
    return bool(tx.execute(_FENCED_INSERT, _insert_binds(run_id, key, encoded, token)).rowcount == 1)


def _insert_binds(run_id: str, key: StepKey, encoded: str, token: str) -> dict[str, Any]:
    return {"run_id": run_id, "name": key.name, "occurrence": key.occurrence, "result": encoded,
            "created_at": SYSTEM_CLOCK.now(), "token": token}
