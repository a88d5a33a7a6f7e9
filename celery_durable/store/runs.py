"""SQL for durable runs: start an attempt under a lease (or find why not), renew, hand off, settle, cancel,
reopen; recovery's and the sleepers' reads, and the purge. The operator's and the gauges' reads (listings,
counts, a run's steps) are store/run_reads.py's.

The run lease: an attempt executing a run holds it (``lease_holder`` = the
attempt's token, ``lease_expires_at`` renewed by its process's heartbeat). A
delivery of the run may start an attempt only when no live attempt holds it:
no holder; or a holder whose heartbeat stopped (expired, counted as a lost
attempt); or a holder that handed the run to exactly this message (its
``durable_resume`` token: a durable sleep's wake-up, a re-send after a store
outage). So a second copy of a live run never runs beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from celery_durable.store.attempt_sql import (
    START_WITHOUT_FLUSH_WAIT,
    attempt_binds,
    begin_attempt_sql,
    start_skips_flush_wait,
    typed_attempt_binds,
)
from celery_durable.store.clock import store_now
from celery_durable.store.driver_sql import DriverStatement
from celery_durable.store.schema import (
    CANCELLED,
    DEAD,
    FAILED,
    INDEXED_STATES,
    RUNNING,
    SETTLED,
    SLEEPING,
    SUPPORTED_BACKENDS,
    by_state,
    runs,
    steps,
)

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
    lease_holder: str | None = None
    lease_expires_at: datetime | None = None
    lost_attempts: int = 0
    retries: int = 0
    wake_at: datetime | None = None
    settled_by: str | None = None

    @property
    def settled(self) -> bool:
        return self.state in SETTLED

    def lease_live(self, at: datetime) -> bool:
        """Whether an attempt's heartbeat still vouches for this run at ``at``."""
        expires = self.lease_expires_at
        return self.lease_holder is not None and expires is not None and expires > at


def render_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 15] + "... [truncated]"


def _begin_attempt_statement(lead: str = "") -> DriverStatement:
    returning = ", ".join(c.name for c in runs.c)
    return DriverStatement(typed_attempt_binds(sa.text(f"{lead}{begin_attempt_sql()} RETURNING {returning}")),
                           columns=tuple(runs.c))


_BEGIN_ATTEMPT = _begin_attempt_statement()
#: PostgreSQL on an autocommit connection: the start's commit does not wait for the WAL flush
#: (attempt_sql.START_WITHOUT_FLUSH_WAIT says why that loses nothing). SQLite takes one statement per call.
_BEGIN_ATTEMPT_NO_FLUSH_WAIT = _begin_attempt_statement(START_WITHOUT_FLUSH_WAIT)


def _settle_statement() -> sa.Update:
    # Built once: building the UPDATE and its cache key per call cost ~0.25 ms a run. The holder is
    # compared with IS NOT DISTINCT FROM (SQLite: IS): a run buried without a holder has NULL there.
    # The settled states are written into the text (as in begin_attempt_sql): a list of binds is an
    # expanding IN, rendered again on every execution (~20 µs a run).
    settled: list[sa.ColumnElement[str]] = [sa.literal_column(f"'{state}'") for state in sorted(SETTLED)]
    return sa.update(runs).where(
        runs.c.id == sa.bindparam("run_id", type_=runs.c.id.type), runs.c.state.not_in(settled),
        runs.c.lease_holder.is_not_distinct_from(sa.bindparam("holder", type_=runs.c.lease_holder.type)),
    ).values(
        state=sa.bindparam("new_state", type_=runs.c.state.type),
        result=sa.bindparam("new_result", type_=runs.c.result.type),
        updated_at=sa.bindparam("at", type_=runs.c.updated_at.type),
        finished_at=sa.bindparam("finished", type_=runs.c.finished_at.type),
        lease_holder=None, lease_expires_at=None,
        settled_by=sa.bindparam("settler", type_=runs.c.settled_by.type),
        # error=None keeps the last error
        last_error=sa.func.coalesce(sa.bindparam("error", type_=runs.c.last_error.type), runs.c.last_error),
    )


_SETTLE = DriverStatement(_settle_statement())

def _require_supported(conn: Connection) -> None:
    if conn.dialect.name not in SUPPORTED_BACKENDS:
        raise NotImplementedError(f"celery_durable supports PostgreSQL and SQLite, not {conn.dialect.name}")


def begin_attempt(conn: Connection, *, run_id: str, task_name: str, queue: str | None,
                  args: str, kwargs: str, token: str, lease_seconds: float,
                  resume: str | None = None, retries: int = 0) -> tuple[Run, bool]:
    """Take the run's lease for a starting attempt: (the run, True) — or (the run as found, False).

    One statement (on PostgreSQL in autocommit, led by ``SET LOCAL``: its commit
    does not wait for the flush, see attempt_sql.py): insert the run, or count one
    more attempt on a run that has not settled and that no live attempt holds (``resume``: the hand-off token
    the delivered message carries). ``False`` comes with the row as it stands:
    settled, live under another attempt, or sleeping until its own wake-up.
    """
    _require_supported(conn)
    at = store_now(conn)
    begin = _BEGIN_ATTEMPT_NO_FLUSH_WAIT if start_skips_flush_wait(conn) else _BEGIN_ATTEMPT
    rows = begin.rows(conn, attempt_binds(
        run_id=run_id, task_name=task_name, queue=queue, args=args, kwargs=kwargs, token=token, at=at,
        lease_seconds=lease_seconds, resume=resume, retries=retries))
    if rows:  # the primary key's upsert: one row at most
        return Run(**rows[0]), True
    found = get(conn, run_id)
    if found is None:  # deleted between the two statements: run it as new next time
        raise RuntimeError(f"run {run_id} vanished while starting")
    return found, False


def renew(conn: Connection, leases: dict[str, str], lease_seconds: float) -> set[str]:
    """Push out the expiry of the leases ``{run_id: token}`` still held; returns the run ids renewed."""
    if not leases:
        return set()
    expires = store_now(conn) + timedelta(seconds=lease_seconds)
    renewed: set[str] = set()
    # One UPDATE per token would cost a round trip per run: the ids select the
    # rows by primary key and the tokens are checked on what comes back.
    rows = conn.execute(
        sa.update(runs).where(runs.c.id.in_(sorted(leases)), runs.c.lease_holder.in_(sorted(set(leases.values()))),
                              runs.c.state == RUNNING)
        .values(lease_expires_at=expires).returning(runs.c.id, runs.c.lease_holder)
    )
    for run_id, holder in rows:
        if leases.get(run_id) == holder:
            renewed.add(run_id)
    return renewed


def holders(conn: Connection, run_ids: list[str]) -> dict[str, str | None]:
    """The lease holder each run names now (None: no attempt holds it)."""
    rows = conn.execute(sa.select(runs.c.id, runs.c.lease_holder).where(runs.c.id.in_(sorted(run_ids))))
    return {run_id: holder for run_id, holder in rows}


def hand_off_to_sleep(conn: Connection, run_id: str, token: str, wake_at: datetime | None = None) -> bool:
    """Mark a run sleeping: its attempt ended, and only the wake-up carrying ``token`` may resume it.

    ``wake_at``: when the wake-up is due (the fleet sends it again if it is long overdue).
    """
    result = conn.execute(
        sa.update(runs).where(runs.c.id == run_id, runs.c.lease_holder == token, runs.c.state == RUNNING)
        .values(state=SLEEPING, lease_expires_at=None, wake_at=wake_at, updated_at=store_now(conn))
    )
    return bool(result.rowcount == 1)


def stranded(conn: Connection, before: datetime, resend_before: datetime, limit: int) -> list[Run]:
    """Runs no delivery took over, locked for sending again (PostgreSQL skips rows another has).

    A ``running`` run whose attempt's lease expired before ``before`` (its
    process died and no copy of its message took it over); one handed to a
    message (a re-send, a store wait) before ``resend_before`` that never came;
    a ``sleeping`` run whose wake-up was due before ``before``.
    """
    # The index's condition in each branch of the OR: SQLite weighs an index for each branch alone.
    lapsed = sa.and_(runs.c.state == RUNNING, INDEXED_STATES, runs.c.lease_holder.is_not(None),
                     sa.or_(runs.c.lease_expires_at < before,
                            sa.and_(runs.c.lease_expires_at.is_(None), runs.c.updated_at < resend_before)))
    overdue = sa.and_(runs.c.state == SLEEPING, INDEXED_STATES, runs.c.wake_at < before)
    query = sa.select(runs).where(sa.or_(lapsed, overdue)).order_by(runs.c.updated_at).limit(limit)
    if conn.dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    return [Run(**row._mapping) for row in conn.execute(query)]


def hand_off_to_resend(conn: Connection, run: Run, new_token: str, at: datetime) -> str | None:
    """Hand a stranded run to the message about to be sent; the token it must carry, or None if it moved.

    A lapsed lease's run gets ``new_token``, and its dead attempt counts as
    lost (as a copy taking over the lease would count it), so a run that keeps
    killing its workers is still buried. A run already handed to a message, or
    sleeping, keeps its token: every copy sent for it is then the same
    hand-off, and whichever arrives first resumes it (a new token per re-send
    would strand the copies already queued behind a backlog).
    """
    unchanged = (runs.c.id == run.id, runs.c.state == run.state, runs.c.lease_holder == run.lease_holder)
    if run.state == RUNNING and run.lease_expires_at is not None:
        token: str | None = new_token
        values: dict[str, Any] = {"lease_holder": new_token, "lease_expires_at": None,
                                  "lost_attempts": runs.c.lost_attempts + 1, "updated_at": at}
    else:
        token = run.lease_holder
        # A sleeping run's wake-up counts as due again from now: sent once per TTL at most.
        values = {"updated_at": at, **({"wake_at": at} if run.state == SLEEPING else {})}
    written = conn.execute(sa.update(runs).where(*unchanged).values(**values))
    return token if written.rowcount == 1 else None


def settle(conn: Connection, run: Run, state: str, *, result: str | None = None,
           error: str | None = None) -> Run | None:
    """Write the outcome of this attempt and give up its lease; returns the run as it now stands.

    None when the attempt no longer holds the run: a revoke cancelled it, or
    its heartbeat stopped long enough for another attempt to take over. The
    first outcome stands. ``error=None`` keeps the last error: a run that
    succeeded on a retry still shows what failed before. A settled outcome
    names the attempt that wrote it (``settled_by``): see :func:`claim_unseen_outcome`.
    """
    at = store_now(conn)
    values: dict[str, Any] = {"state": state, "result": result, "updated_at": at,
                              "finished_at": at if state in SETTLED else None,
                              "lease_holder": None, "lease_expires_at": None,
                              "settled_by": run.lease_holder if state in SETTLED else None}
    if error is not None:
        values["last_error"] = error
    written = _SETTLE.execute(conn, {"run_id": run.id, "holder": run.lease_holder, "new_state": state,
                                     "new_result": result, "at": at, "finished": values["finished_at"],
                                     "settler": values["settled_by"], "error": error})
    if written != 1:
        return None
    return Run(**{**run.__dict__, **values})


def claim_unseen_outcome(conn: Connection, run_id: str, settler: str) -> Run | None:
    """Claim the outcome the attempt ``settler`` wrote without hearing the reply: the run, for one caller only.

    The settler's COMMIT reached the store but its reply was lost, so the
    settler counted nothing and called no ``on_settled``. It claims the
    outcome itself once the store answers again or, if the store stayed
    away, the re-send carrying its token does. One conditional UPDATE clears
    ``settled_by``: whichever caller matches the row reports the outcome,
    every other (a second copy of the re-send) gets None.
    """
    row = conn.execute(
        sa.update(runs).where(runs.c.id == run_id, runs.c.settled_by == settler).values(settled_by=None)
        .returning(*runs.c)
    ).one_or_none()
    return None if row is None else Run(**row._mapping)


def cancel(conn: Connection, *, run_id: str, task_name: str, queue: str | None, args: str, kwargs: str,
           reason: str) -> Run | None:
    """Settle a run as cancelled, or record it cancelled before it ever started; None if it had settled.

    One statement, like :func:`begin_attempt`: whichever of a cancel and an
    attempt's outcome is written first stands.
    """
    _require_supported(conn)
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    at = store_now(conn)
    # Built per call (not cached like begin_attempt's): a cancel is rare.
    stmt = insert(runs).values(
        id=run_id, task_name=task_name, queue=queue, state=CANCELLED, attempts=0, args=args,
        kwargs=kwargs, last_error=reason, started_at=at, updated_at=at, finished_at=at,
    )
    upsert = stmt.on_conflict_do_update(
        index_elements=[runs.c.id],
        set_={"state": CANCELLED, "last_error": reason, "updated_at": at, "finished_at": at,
              "lease_holder": None, "lease_expires_at": None},
        where=runs.c.state.not_in(sorted(SETTLED)),
    ).returning(*runs.c)
    row = conn.execute(upsert).one_or_none()
    return None if row is None else Run(**row._mapping)


def bury(conn: Connection, *, run_id: str, task_name: str, queue: str | None, args: str, kwargs: str,
         reason: str) -> Run | None:
    """Settle dead a run no live attempt holds (or record it dead if it never started); None if it had
    settled or a live attempt holds it. The broker's claim calls it for a message whose holders keep dying."""
    _require_supported(conn)
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    at = store_now(conn)
    stmt = insert(runs).values(
        id=run_id, task_name=task_name, queue=queue, state=DEAD, attempts=0, args=args,
        kwargs=kwargs, last_error=reason, started_at=at, updated_at=at, finished_at=at,
    )
    upsert = stmt.on_conflict_do_update(
        index_elements=[runs.c.id],
        set_={"state": DEAD, "last_error": reason, "updated_at": at, "finished_at": at,
              "lease_holder": None, "lease_expires_at": None},
        where=sa.and_(runs.c.state.not_in(sorted(SETTLED)),
                      sa.or_(runs.c.lease_holder.is_(None), runs.c.lease_expires_at <= at)),
    ).returning(*runs.c)
    row = conn.execute(upsert).one_or_none()
    return None if row is None else Run(**row._mapping)


def get(conn: Connection, run_id: str) -> Run | None:
    row = conn.execute(sa.select(runs).where(runs.c.id == run_id)).one_or_none()
    return None if row is None else Run(**row._mapping)


def reopen(conn: Connection, run_id: str, at: datetime) -> bool:
    """Make a dead run, or one stranded ``running`` under an expired lease, runnable again.

    It goes back to ``failed`` (will run again) with no holder, a fresh
    lost-attempt count and no settler (its old one has no outcome left to
    claim); False if it was neither.
    """
    stranded = sa.and_(runs.c.state == RUNNING,
                       sa.or_(runs.c.lease_holder.is_(None), runs.c.lease_expires_at <= at))
    result = conn.execute(
        sa.update(runs).where(runs.c.id == run_id, sa.or_(runs.c.state == DEAD, stranded))
        .values(state=FAILED, finished_at=None, updated_at=store_now(conn), lease_holder=None, lease_expires_at=None,
                lost_attempts=0, settled_by=None)
    )
    return bool(result.rowcount == 1)


def sleeping(conn: Connection, limit: int) -> list[Run]:
    """Runs waiting for a time (a durable sleep), the soonest wake-up first."""
    query = (sa.select(runs).where(runs.c.state == SLEEPING, INDEXED_STATES).order_by(runs.c.wake_at, runs.c.id)
             .limit(limit))
    return [Run(**row._mapping) for row in conn.execute(query)]


def purge_settled(conn: Connection, before: datetime, states: Sequence[str], batch: int) -> int:
    """Delete up to ``batch`` runs in ``states`` finished before ``before`` (their steps go with them).

    Through the finished-at index (succeeded runs are not in the state index), or the state index for
    states without ``succeeded``.
    """
    chosen = (sa.select(runs.c.id).where(*by_state(states), runs.c.finished_at.is_not(None),
                                         runs.c.finished_at < before).limit(batch))
    ids = [run_id for (run_id,) in conn.execute(chosen)]
    if not ids:
        return 0
    conn.execute(steps.delete().where(steps.c.run_id.in_(ids)))  # SQLite may run without ON DELETE CASCADE
    return int(conn.execute(runs.delete().where(runs.c.id.in_(ids))).rowcount or 0)
