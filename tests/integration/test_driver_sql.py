"""A run's hot statements as driver SQL (PostgreSQL and SQLite): the same rows, types and errors as
``Connection.execute``, on connections that keep their prepared statements."""

from __future__ import annotations

from datetime import timezone
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_durable.errors import StoreUnavailable
from celery_durable.planning.checkpoints import StepKey
from celery_durable.store import runs, steps
from celery_durable.store.attempt_sql import START_WITHOUT_FLUSH_WAIT
from celery_durable.store.driver_sql import DriverStatement
from celery_durable.store.engine import autocommit, ensure_schema, unavailable_as_error
from celery_durable.store.schema import runs as runs_table


@pytest.fixture
def conn(store_url: str):
    with autocommit(ensure_schema(store_url)).connect() as c:
        yield c


def test_a_started_run_reads_back_as_connection_execute_reads_it(conn: Connection):
    run, started = runs.begin_attempt(conn, run_id="r1", task_name="t", queue="q", args="[1]", kwargs="{}",
                                      token="k1", lease_seconds=30)
    assert started
    stored = runs.get(conn, "r1")  # Connection.execute, typed by the table
    assert run == stored
    for at in (run.started_at, run.updated_at, run.lease_expires_at):
        assert at is not None and at.tzinfo is timezone.utc
    assert (run.state, run.attempts, run.lease_holder, run.finished_at) == ("running", 1, "k1", None)


def test_a_settle_writes_its_outcome_and_the_statements_literal_values(conn: Connection):
    run, _ = runs.begin_attempt(conn, run_id="r1", task_name="t", queue="q", args="[]", kwargs="{}",
                                token="k1", lease_seconds=30)
    settled = runs.settle(conn, run, "succeeded", result='"ok"')
    assert settled is not None
    stored = runs.get(conn, "r1")
    # lease_holder and lease_expires_at are values the statement itself carries (NULL), not the caller's.
    assert (stored.state, stored.result, stored.lease_holder, stored.lease_expires_at, stored.settled_by) == \
        ("succeeded", '"ok"', None, None, "k1")
    assert stored.finished_at == settled.finished_at
    assert runs.settle(conn, run, "dead", error="late") is None  # the settled-state guard, in the text


def test_a_checkpoint_written_twice_raises_sqlalchemys_integrity_error(conn: Connection):
    # The checkpoint's wait in place tells "its own earlier try landed" by this exception's type.
    runs.begin_attempt(conn, run_id="r1", task_name="t", queue="q", args="[]", kwargs="{}", token="k1",
                       lease_seconds=30)
    assert steps.insert(conn, "r1", StepKey("a", 0), "1", "k1")
    with pytest.raises(sa.exc.IntegrityError):
        steps.insert(conn, "r1", StepKey("a", 0), "1", "k1")
    assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1  # the connection is still usable


def test_a_statement_with_an_expanding_in_is_refused_when_first_compiled(conn: Connection):
    statement = DriverStatement(sa.select(runs_table.c.id).where(runs_table.c.state.in_(["a", "b"])))
    with pytest.raises(ValueError, match="expanding"):
        statement.execute(conn, {})


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_sqlite_autocommit_connections_are_not_switched_per_use(store_url: str):
    # Resetting the isolation level on each return ran PRAGMA read_uncommitted, which expires every
    # statement the connection had prepared: each run compiled its statements again (~0.5 ms a run).
    engine = autocommit(ensure_schema(store_url))
    with engine.connect() as first:
        raw = first.connection.dbapi_connection
        seen: list[str] = []
        raw.set_trace_callback(seen.append)
    try:
        for _ in range(3):
            with engine.connect() as again:
                assert again.connection.dbapi_connection is raw  # the pooled connection, reused
                again.exec_driver_sql("SELECT 1")
    finally:
        raw.set_trace_callback(None)
    assert seen == ["SELECT 1"] * 3


def _start(conn: Connection, run_id: str = "r1", token: str = "k1") -> runs.Run:
    run, started = runs.begin_attempt(conn, run_id=run_id, task_name="t", queue="q", args="[]", kwargs="{}",
                                      token=token, lease_seconds=30)
    assert started
    return run


def test_every_statement_reaches_the_cursor_listeners_of_its_engine(conn: Connection):
    # Statements counted by before_cursor_execute (the benchmarks' round trips, tests' statement counts)
    # are each seen, though a run's statements skip SQLAlchemy's execution when nobody listens.
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        # A PostgreSQL start's message leads with its SET LOCAL (store/attempt_sql.py): its verb is the INSERT's.
        seen.append(statement.removeprefix(START_WITHOUT_FLUSH_WAIT).split(None, 1)[0])

    sa.event.listen(conn.engine, "before_cursor_execute", record)
    try:
        run = _start(conn)
        assert steps.insert(conn, "r1", StepKey("a", 0), "1", "k1")
        assert runs.settle(conn, run, "succeeded", result="1") is not None
    finally:
        sa.event.remove(conn.engine, "before_cursor_execute", record)
    assert [s for s in seen if s != "SELECT"] == ["INSERT", "INSERT", "UPDATE"]  # SELECT: the store's clock


def test_outside_autocommit_a_statement_stays_in_the_callers_transaction(store_url: str):
    # Only an autocommit connection's statements go straight to the driver: on any other the statement
    # is part of the transaction SQLAlchemy begins, and goes with its rollback.
    engine = ensure_schema(store_url)
    with engine.connect() as caller:
        _start(caller)
        assert runs.get(caller, "r1") is not None
        caller.rollback()
    with autocommit(engine).connect() as other:
        assert runs.get(other, "r1") is None


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_a_connection_lost_under_a_statement_is_an_outage_and_is_dropped(store_url: str):
    # The driver's error handed to SQLAlchemy's own handling: an OperationalError read as the store
    # being out, the connection invalidated (the step context then opens a fresh one), and the idle
    # connections of the sibling engine dropped with it (handle_error, store.engine._share_disconnects).
    engine = ensure_schema(store_url)
    with engine.connect() as idle:
        idle.exec_driver_sql("SELECT 1")
    assert engine.pool.checkedin() == 1
    with autocommit(engine).connect() as conn:
        _start(conn)
        backend = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        with engine.connect() as killer:
            killer.exec_driver_sql(f"SELECT pg_terminate_backend({backend})")
            killer.commit()
        checkedin_before = engine.pool.checkedin()
        with pytest.raises(StoreUnavailable) as raised:
            with unavailable_as_error(store_url):
                steps.insert(conn, "r1", StepKey("a", 0), "1", "k1")
        cause = raised.value.__cause__
        assert isinstance(cause, sa.exc.OperationalError) and cause.connection_invalidated
        assert conn.invalidated
        assert checkedin_before >= 1 and engine.pool.checkedin() == 0
    with autocommit(engine).connect() as fresh:  # the store answers again on a fresh connection
        assert steps.insert(fresh, "r1", StepKey("a", 0), "1", "k1")
