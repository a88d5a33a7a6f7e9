"""Migration 0015 (the state index leaves out succeeded runs) on PostgreSQL and SQLite: a store at 0014 with
runs in every state upgrades, every read by state still finds its runs (succeeded ones included), new runs
start and settle, and the migration goes back down and up again with the rows intact."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy.engine import Connection

from celery_durable.planning.checkpoints import StepKey
from celery_durable.store import attempts, run_reads, runs, steps
from celery_durable.store.engine import alembic_config, current_revision, engine_for, migrate
from celery_durable.store.schema import (
    CANCELLED,
    DEAD,
    FAILED,
    HEAD_REVISION,
    RUNNING,
    SETTLED,
    SLEEPING,
    SUCCEEDED,
)
from celery_durable.store.schema import runs as runs_table

PREVIOUS = "0014_fewer_run_page_writes"
AT = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
FAR = AT + timedelta(days=3650)

#: One run per state: (id, state, lease holder, lease expiry, wake-up).
RUNS = (
    ("ok-1", SUCCEEDED, None, None, None),
    ("ok-2", SUCCEEDED, None, None, None),
    ("live", RUNNING, "tok-live", FAR, None),
    ("lapsed", RUNNING, "tok-lapsed", AT, None),
    ("nap", SLEEPING, "tok-nap", None, AT),
    ("retry", FAILED, None, None, None),
    ("grave", DEAD, None, None, None),
    ("stop", CANCELLED, None, None, None),
)


def _state_index_condition(conn: Connection) -> str | None:
    """The WHERE of ``ix_durable_runs_state`` as the database keeps it; None for an index over every run."""
    if conn.dialect.name == "sqlite":
        sql = conn.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'index' AND name = 'ix_durable_runs_state'").scalar_one()
        where = str(sql).partition(" WHERE ")[2]
        return where or None
    definition = str(conn.exec_driver_sql(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = current_schema() "
        "AND indexname = 'ix_durable_runs_state'").scalar_one())
    return definition.partition(" WHERE ")[2] or None


def _leaves_out_succeeded(conn: Connection) -> bool:
    condition = _state_index_condition(conn)
    return condition is not None and "succeeded" in condition and "<>" in condition


def _row(run_id: str, state: str, holder: str | None, expires: datetime | None, wake: datetime | None
         ) -> dict[str, Any]:
    finished = AT + timedelta(seconds=1) if state in SETTLED else None
    return {"id": run_id, "task_name": "t.three", "queue": "q", "state": state, "attempts": 1, "args": "[1]",
            "kwargs": "{}", "result": "3" if state == SUCCEEDED else None,
            "last_error": "Boom: no" if state in (DEAD, FAILED) else None, "started_at": AT,
            "updated_at": finished or AT, "finished_at": finished, "lease_holder": holder,
            "lease_expires_at": expires, "wake_at": wake}


def _store_at_previous_revision(url: str) -> None:
    from alembic import command

    with engine_for(url).begin() as conn:
        command.upgrade(alembic_config(url, conn), PREVIOUS)
        assert current_revision(conn) == PREVIOUS
        conn.execute(runs_table.insert(), [_row(*run) for run in RUNS])


def _ids(found: list[runs.Run]) -> set[str]:
    return {run.id for run in found}


def _assert_reads_by_state(conn: Connection) -> None:
    """Every store read that names the state column finds what it did before the migration."""
    assert run_reads.count_by_state(conn) == {SUCCEEDED: 2, RUNNING: 2, SLEEPING: 1, FAILED: 1, DEAD: 1, CANCELLED: 1}
    assert _ids(run_reads.listed(conn, states=[SUCCEEDED])) == {"ok-1", "ok-2"}
    assert _ids(run_reads.listed(conn, states=[SUCCEEDED, DEAD])) == {"ok-1", "ok-2", "grave"}
    assert _ids(run_reads.listed(conn, states=[RUNNING, SLEEPING])) == {"live", "lapsed", "nap"}
    assert _ids(run_reads.listed(conn, states=[DEAD])) == {"grave"}
    assert len(run_reads.listed(conn)) == len(RUNS)
    assert _ids(runs.sleeping(conn, 10)) == {"nap"}
    assert run_reads.dead_by_queue(conn) == {"q": 1}
    # Recovery: the running run whose lease lapsed and the sleeping run whose wake-up is overdue.
    assert _ids(runs.stranded(conn, AT + timedelta(minutes=1), AT, 10)) == {"lapsed", "nap"}


def _assert_rows_intact(conn: Connection) -> None:
    for run_id, state, holder, expires, wake in RUNS:
        found = runs.get(conn, run_id)
        assert found is not None
        assert (found.state, found.lease_holder, found.lease_expires_at, found.wake_at) == (state, holder, expires,
                                                                                           wake)
    _assert_reads_by_state(conn)


def test_a_store_at_0014_migrates_and_every_read_by_state_still_finds_its_runs(store_url):
    _store_at_previous_revision(store_url)
    with engine_for(store_url).connect() as conn:
        assert not _leaves_out_succeeded(conn)

    assert migrate(store_url) == (PREVIOUS, HEAD_REVISION)

    with engine_for(store_url).begin() as conn:
        assert _leaves_out_succeeded(conn)
        _assert_rows_intact(conn)
        # New writes through the store's own statements: a run from start to a succeeded settle, the
        # live run's next checkpoint, and a revoke that cancels the live run.
        started = attempts.start(conn, run_id="new", task_name="t.three", queue="q", args="[2]", kwargs="{}",
                                 token="tok-new", lease_seconds=60)
        assert started.started
        assert run_reads.count_by_state(conn)[RUNNING] == 3
        assert steps.insert(conn, "new", StepKey("a", 0), '"new-a-0"', "tok-new")
        assert runs.settle(conn, started.run, SUCCEEDED, result="6") is not None
        assert steps.insert(conn, "live", StepKey("a", 0), '"live-a-0"', "tok-live")
        assert runs.cancel(conn, run_id="live", task_name="t.three", queue="q", args="[1]", kwargs="{}",
                           reason="revoked") is not None
        assert run_reads.count_by_state(conn) == {SUCCEEDED: 3, RUNNING: 1, SLEEPING: 1, FAILED: 1, DEAD: 1,
                                             CANCELLED: 2}
        assert _ids(run_reads.listed(conn, states=[SUCCEEDED])) == {"ok-1", "ok-2", "new"}
        assert runs.reopen(conn, "grave", AT) and run_reads.dead_by_queue(conn) == {}
        # Retention: succeeded runs through the finished-at index, cancelled ones beside them.
        assert runs.purge_settled(conn, AT + timedelta(minutes=1), [SUCCEEDED, CANCELLED], batch=10) == 3
        assert run_reads.count_by_state(conn) == {SUCCEEDED: 1, RUNNING: 1, SLEEPING: 1, FAILED: 2, CANCELLED: 1}


def test_migration_0015_goes_down_and_up_again_with_the_rows_intact(store_url):
    from alembic import command

    _store_at_previous_revision(store_url)
    migrate(store_url)
    with engine_for(store_url).begin() as conn:
        command.downgrade(alembic_config(store_url, conn), PREVIOUS)
        assert current_revision(conn) == PREVIOUS
        assert _state_index_condition(conn) is None
        _assert_rows_intact(conn)
        command.upgrade(alembic_config(store_url, conn), "head")
        assert current_revision(conn) == HEAD_REVISION
        assert _leaves_out_succeeded(conn)
        _assert_rows_intact(conn)
