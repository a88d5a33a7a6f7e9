"""Migration 0014 (fewer pages written per run) on PostgreSQL and SQLite: a store at 0013 with runs and
steps in it upgrades, keeps every row readable and writable, and goes back down intact."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy.engine import Connection

from celery_durable.planning.checkpoints import StepKey
from celery_durable.store import attempts, runs, steps
from celery_durable.store.engine import alembic_config, current_revision, engine_for, migrate
from celery_durable.store.schema import HEAD_REVISION, RUNNING, SUCCEEDED
from celery_durable.store.schema import runs as runs_table
from celery_durable.store.schema import steps as steps_table

PREVIOUS = "0013_beat_schedule"
AT = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


def _finished_index_is_partial(conn: Connection) -> bool:
    """Whether ``ix_durable_runs_finished_at`` holds only rows with ``finished_at`` set."""
    if conn.dialect.name == "sqlite":
        partial = {row[1]: bool(row[4]) for row in conn.exec_driver_sql("PRAGMA index_list(durable_runs)")}
        return partial["ix_durable_runs_finished_at"]
    definition = conn.exec_driver_sql(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = current_schema() "
        "AND indexname = 'ix_durable_runs_finished_at'").scalar_one()
    return "WHERE (finished_at IS NOT NULL)" in str(definition)


def _run_row(run_id: str, state: str, finished: datetime | None) -> dict[str, Any]:
    return {"id": run_id, "task_name": "t.three", "queue": "q", "state": state, "attempts": 1, "args": "[1]",
            "kwargs": "{}", "result": "3" if finished else None, "last_error": None, "started_at": AT,
            "updated_at": finished or AT, "finished_at": finished,
            "lease_holder": None if finished else "tok-live",
            "lease_expires_at": None if finished else AT + timedelta(days=3650)}


def _store_at_previous_revision(url: str) -> None:
    from alembic import command

    with engine_for(url).begin() as conn:
        command.upgrade(alembic_config(url, conn), PREVIOUS)
        assert current_revision(conn) == PREVIOUS
        conn.execute(runs_table.insert(), [_run_row("done", SUCCEEDED, AT + timedelta(seconds=1)),
                                           _run_row("live", RUNNING, None)])
        conn.execute(steps_table.insert(), [
            {"run_id": run_id, "name": name, "occurrence": occurrence, "result": f'"{run_id}-{name}-{occurrence}"',
             "created_at": AT}
            for run_id in ("done", "live") for name, occurrence in (("a", 0), ("b", 0), ("b", 1))])


def _expected_steps(run_id: str) -> dict[StepKey, str]:
    return {StepKey(name, occurrence): f'"{run_id}-{name}-{occurrence}"'
            for name, occurrence in (("a", 0), ("b", 0), ("b", 1))}


def _assert_rows_intact(conn: Connection) -> None:
    done, live = runs.get(conn, "done"), runs.get(conn, "live")
    assert done is not None and (done.state, done.result, done.finished_at) == (SUCCEEDED, "3",
                                                                                 AT + timedelta(seconds=1))
    assert live is not None and (live.state, live.lease_holder, live.finished_at) == (RUNNING, "tok-live", None)
    for run_id in ("done", "live"):
        assert steps.load(conn, run_id) == _expected_steps(run_id)


def test_a_store_at_0013_migrates_and_keeps_its_runs_and_steps(store_url):
    _store_at_previous_revision(store_url)
    with engine_for(store_url).connect() as conn:
        assert not _finished_index_is_partial(conn)

    assert migrate(store_url) == (PREVIOUS, HEAD_REVISION)

    with engine_for(store_url).begin() as conn:
        assert _finished_index_is_partial(conn)
        _assert_rows_intact(conn)
        # The migrated tables take new writes through the store's own statements: the live run's
        # next checkpoint (fenced by its lease), a new run start to settle.
        assert steps.insert(conn, "live", StepKey("c", 0), '"live-c-0"', "tok-live")
        assert not steps.insert(conn, "live", StepKey("d", 0), '"stolen"', "tok-other")
        started = attempts.start(conn, run_id="new", task_name="t.three", queue="q", args="[2]", kwargs="{}",
                                 token="tok-new", lease_seconds=60)
        assert started.started and started.checkpoints == {}
        assert steps.insert(conn, "new", StepKey("a", 0), '"new-a-0"', "tok-new")
        settled = runs.settle(conn, started.run, SUCCEEDED, result="6")
        assert settled is not None and settled.finished_at is not None
        assert steps.load(conn, "live")[StepKey("c", 0)] == '"live-c-0"'
        # Retention finds finished runs through the partial index's rows and takes their steps along.
        assert runs.purge_settled(conn, AT + timedelta(minutes=1), [SUCCEEDED], batch=10) == 1
        assert runs.get(conn, "done") is None and steps.load(conn, "done") == {}
        assert runs.get(conn, "new") is not None


def test_migration_0014_goes_down_and_up_again_with_the_rows_intact(store_url):
    from alembic import command

    _store_at_previous_revision(store_url)
    migrate(store_url)
    with engine_for(store_url).begin() as conn:
        command.downgrade(alembic_config(store_url, conn), PREVIOUS)
        assert current_revision(conn) == PREVIOUS
        assert not _finished_index_is_partial(conn)
        _assert_rows_intact(conn)
        command.upgrade(alembic_config(store_url, conn), "head")
        assert current_revision(conn) == HEAD_REVISION
        assert _finished_index_is_partial(conn)
        _assert_rows_intact(conn)
