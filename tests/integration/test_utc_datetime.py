"""The store's one datetime column type: every timestamp comes back an aware UTC datetime, on SQLite too."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import sqlalchemy as sa

from celery_durable.store.engine import engine_for, ensure_schema
from celery_durable.store.schema import rate_limits

NOON_UTC = datetime(2030, 1, 1, 12, 0, 0, 250000, tzinfo=timezone.utc)


def _read(url: str, task: str) -> datetime:
    with engine_for(url).connect() as conn:
        return conn.execute(sa.select(rate_limits.c.tat).where(rate_limits.c.task_name == task)).scalar_one()


def test_a_timestamp_written_in_any_offset_reads_back_as_the_same_instant_in_utc(store_url):
    ensure_schema(store_url)
    two_hours_ahead = NOON_UTC.astimezone(timezone(timedelta(hours=2)))
    with engine_for(store_url).begin() as conn:
        conn.execute(rate_limits.insert(), [dict(task_name="utc", tat=NOON_UTC),
                                            dict(task_name="ahead", tat=two_hours_ahead),
                                            dict(task_name="naive", tat=NOON_UTC.replace(tzinfo=None))])
    for task in ("utc", "ahead", "naive"):
        read = _read(store_url, task)
        assert read == NOON_UTC and read.tzinfo == timezone.utc, (task, read)


def test_an_aggregate_of_a_timestamp_column_reads_back_aware_utc(store_url):
    ensure_schema(store_url)
    with engine_for(store_url).begin() as conn:
        conn.execute(rate_limits.insert(), [dict(task_name="a", tat=NOON_UTC),
                                            dict(task_name="b", tat=NOON_UTC + timedelta(hours=1))])
        earliest = conn.execute(sa.select(sa.func.min(rate_limits.c.tat))).scalar_one()
    assert earliest == NOON_UTC and earliest.tzinfo == timezone.utc
    # And it compares with the clock's aware now, which a naive value could not.
    assert earliest < datetime.now(timezone.utc) + timedelta(days=36500)
