"""SQL for durable runs: start an attempt (or find it settled), settle or cancel it, read it, reopen a dead one."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from .schema import CANCELLED, DEAD, FAILED, RUNNING, SETTLED, SUPPORTED_BACKENDS, runs

#: Longest rendered error kept on a run: a traceback-sized message must not bloat the row.
MAX_ERROR_CHARS = 2000


@dataclass(frozen=True)
class Run:
    """One row of ``durable_runs``; what ``on_settled(run)`` is handed."""

    id: str
    task_name: str
    queue: str | None
    state: str
    attempts: int
    args: str
    kwargs: str
    result: str | None
    last_error: str | None
    started_at: datetime
    updated_at: datetime
    finished_at: datetime | None

    @property
    def settled(self) -> bool:
        return self.state in SETTLED


def now() -> datetime:
    return datetime.now(timezone.utc)


def render_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 15] + "... [truncated]"


def _begin_attempt_statement() -> sa.TextClause:
    # Written out once rather than built per call: SQLAlchemy cannot cache an
    # ON CONFLICT construct ("no key"), and recompiling it cost ~1 ms per run.
    # The same text is valid on PostgreSQL and on SQLite (>= 3.35, RETURNING).
    settled = ", ".join(f"'{state}'" for state in sorted(SETTLED))
    columns = ", ".join(c.name for c in runs.c)
    return sa.text(
        f"INSERT INTO {runs.name} (id, task_name, queue, state, attempts, args, kwargs, started_at, updated_at) "
        f"VALUES (:id, :task_name, :queue, '{RUNNING}', 1, :args, :kwargs, :at, :at) "
        f"ON CONFLICT (id) DO UPDATE SET state = '{RUNNING}', attempts = {runs.name}.attempts + 1, "
        f"updated_at = :at WHERE {runs.name}.state NOT IN ({settled}) "
        f"RETURNING {columns}"
    ).bindparams(sa.bindparam("at", type_=runs.c.started_at.type)).columns(*runs.c)


_BEGIN_ATTEMPT = _begin_attempt_statement()


def _require_supported(conn: Connection) -> None:
    if conn.dialect.name not in SUPPORTED_BACKENDS:
        raise NotImplementedError(f"celery_durable supports PostgreSQL and SQLite, not {conn.dialect.name}")


def begin_attempt(conn: Connection, *, run_id: str, task_name: str, queue: str | None,
                  args: str, kwargs: str) -> tuple[Run, bool]:
    """Record an attempt starting: (the run, True) — or (the settled run, False) if it must not run.

    One statement: insert the run, or count one more attempt on a run that has
    not settled. A settled run is left as it is and read back.
    """
    _require_supported(conn)
    row = conn.execute(_BEGIN_ATTEMPT, {"id": run_id, "task_name": task_name, "queue": queue,
                                        "args": args, "kwargs": kwargs, "at": now()}).one_or_none()
    if row is not None:
        return Run(**row._mapping), True
    settled = get(conn, run_id)
    if settled is None:  # deleted between the two statements: run it as new next time
        raise RuntimeError(f"run {run_id} vanished while starting")
    return settled, False


def settle(conn: Connection, run: Run, state: str, *, result: str | None = None,
           error: str | None = None) -> Run | None:
    """Write the outcome of this attempt; returns the run as it now stands.

    None when the run settled meanwhile (a revoke cancelled it while this
    attempt ran): the first outcome stands. ``error=None`` keeps the last
    error: a run that succeeded on a retry still shows what failed before.
    """
    at = now()
    values: dict[str, Any] = {"state": state, "result": result, "updated_at": at,
                              "finished_at": at if state in SETTLED else None}
    if error is not None:
        values["last_error"] = error
    written = conn.execute(
        sa.update(runs).where(runs.c.id == run.id, runs.c.state.not_in(sorted(SETTLED))).values(**values)
    )
    if written.rowcount != 1:
        return None
    return Run(**{**run.__dict__, **values})


def cancel(conn: Connection, *, run_id: str, task_name: str, queue: str | None, args: str, kwargs: str,
           reason: str) -> Run | None:
    """Settle a run as cancelled, or record it cancelled before it ever started; None if it had settled.

    One statement, like :func:`begin_attempt`: whichever of a cancel and an
    attempt's outcome is written first stands.
    """
    _require_supported(conn)
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    at = now()
    # Built per call (not cached like begin_attempt's): a cancel is rare.
    stmt = insert(runs).values(
        id=run_id, task_name=task_name, queue=queue, state=CANCELLED, attempts=0, args=args,
        kwargs=kwargs, last_error=reason, started_at=at, updated_at=at, finished_at=at,
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[runs.c.id],
        set_={"state": CANCELLED, "last_error": reason, "updated_at": at, "finished_at": at},
        where=runs.c.state.not_in(sorted(SETTLED)),
    ).returning(*runs.c)
    row = conn.execute(stmt).one_or_none()
    return None if row is None else Run(**row._mapping)


def get(conn: Connection, run_id: str) -> Run | None:
    row = conn.execute(sa.select(runs).where(runs.c.id == run_id)).one_or_none()
    return None if row is None else Run(**row._mapping)


def reopen_dead(conn: Connection, run_id: str) -> bool:
    """Move a dead run back to ``failed`` (will run again); False if it was not dead."""
    result = conn.execute(
        sa.update(runs).where(runs.c.id == run_id, runs.c.state == DEAD)
        .values(state=FAILED, finished_at=None, updated_at=now())
    )
    return bool(result.rowcount == 1)
