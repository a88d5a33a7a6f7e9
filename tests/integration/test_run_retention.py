"""Run retention's SQL and its one-purge-at-a-time rule, on PostgreSQL and SQLite."""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa

from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.store import runs as store_runs
from celery_durable.store.engine import engine_for, ensure_schema
from celery_durable.store.schema import DEAD, SUCCEEDED
from celery_durable.tasks.retention import PURGE_LOCK, purge_runs


def _settled(url: str, count: int, state: str, days_ago: float) -> None:
    at = SYSTEM_CLOCK.now() - timedelta(days=days_ago)
    with engine_for(url).begin() as conn:
        conn.execute(store_runs.runs.insert(), [
            dict(id=f"{state}-{days_ago}-{n}", task_name="t", queue=None, state=state, attempts=1, args="[]",
                 kwargs="{}", started_at=at, updated_at=at, finished_at=at) for n in range(count)])


def _count(url: str) -> int:
    with engine_for(url).connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(store_runs.runs)).scalar_one())


def test_old_settled_runs_go_in_batches_and_the_rest_stay(store_url):
    ensure_schema(store_url)
    _settled(store_url, 7, SUCCEEDED, days_ago=10)
    _settled(store_url, 2, SUCCEEDED, days_ago=1)
    _settled(store_url, 3, DEAD, days_ago=10)
    assert purge_runs(store_url, 5 * 86400, batch=3) == 7, "three batches: 3, 3 and 1"
    assert _count(store_url) == 5
    assert purge_runs(store_url, 5 * 86400, states=(SUCCEEDED, DEAD)) == 3
    assert _count(store_url) == 2


def test_one_purge_at_a_time_across_the_fleet(tmp_path):
    from tests.stores import fresh_store

    with fresh_store("postgresql", tmp_path) as url:
        ensure_schema(url)
        _settled(url, 4, SUCCEEDED, days_ago=10)
        with engine_for(url).connect() as other, other.begin():
            other.exec_driver_sql(f"SELECT pg_advisory_xact_lock({PURGE_LOCK})")  # another worker is purging
            assert purge_runs(url, 86400) == 0
        assert purge_runs(url, 86400) == 4
