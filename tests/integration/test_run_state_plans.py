"""Every store read of runs by state goes through an index, on SQLite and PostgreSQL.

``ix_durable_runs_state`` leaves out succeeded runs (migration 0015), and SQLite uses a partial index
only for a query that repeats its condition: a read that forgot it would scan the whole runs table, a
cost no result shows. So each read's SQL, as the store sends it, is explained here (PostgreSQL with
sequential scans switched off: a plan that still scans the table had no index it could use).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Connection

from celery_durable.store import run_reads, runs
from celery_durable.store.engine import engine_for, ensure_schema
from celery_durable.store.schema import CANCELLED, DEAD, RUNNING, SLEEPING, SUCCEEDED
from celery_durable.store.schema import runs as runs_table

AT = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
STATE_INDEX, FINISHED_INDEX = "ix_durable_runs_state", "ix_durable_runs_finished_at"

#: Each read, called as its callers call it, and the index its plan must name.
READS: dict[str, tuple[Callable[[Connection], Any], str]] = {
    "recovery's stranded runs": (lambda c: runs.stranded(c, AT, AT, 10), STATE_INDEX),
    "sleeping runs (dashboard)": (lambda c: runs.sleeping(c, 10), STATE_INDEX),
    "dead runs per queue (metrics, status)": (run_reads.dead_by_queue, STATE_INDEX),
    "runs by state (status, dashboard)": (run_reads.count_by_state, STATE_INDEX),
    "dead runs listed (dashboard, requeue --all)": (lambda c: run_reads.listed(c, states=[DEAD]), STATE_INDEX),
    "live runs listed": (lambda c: run_reads.listed(c, states=[RUNNING, SLEEPING]), STATE_INDEX),
    "retention of dead runs": (lambda c: runs.purge_settled(c, AT, [DEAD], 10), STATE_INDEX),
    "retention's default states": (lambda c: runs.purge_settled(c, AT, [SUCCEEDED, CANCELLED], 10), FINISHED_INDEX),
}


def _fill(conn: Connection) -> None:
    conn.execute(runs_table.insert(), [
        {"id": f"r-{i}", "task_name": "t", "queue": "q", "state": state, "attempts": 1, "args": "[]", "kwargs": "{}",
         "started_at": AT, "updated_at": AT, "finished_at": AT if state in (SUCCEEDED, DEAD, CANCELLED) else None}
        for i, state in enumerate([SUCCEEDED] * 20 + [RUNNING, SLEEPING, DEAD, CANCELLED])])


def _plans(conn: Connection, read: Callable[[Connection], Any]) -> list[str]:
    """The plan of each statement ``read`` sent that names the runs table, one text per statement."""
    sent: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, params: Any, _context: Any, _many: bool) -> None:
        if "durable_runs" in statement:
            sent.append((statement, params))

    event.listen(conn, "before_cursor_execute", record)
    try:
        read(conn)
    finally:
        event.remove(conn, "before_cursor_execute", record)
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    plans = []
    for statement, params in sent:
        if conn.dialect.name == "sqlite":
            cursor.execute(f"EXPLAIN QUERY PLAN {statement}", params)
            plans.append("\n".join(str(row[3]) for row in cursor.fetchall()))
        else:
            cursor.execute(f"EXPLAIN {statement}", params)
            plans.append("\n".join(str(row[0]) for row in cursor.fetchall()))
    assert plans, "the read sent no statement on durable_runs"
    return plans


@pytest.mark.parametrize("name", list(READS))
def test_a_read_by_state_goes_through_an_index_not_a_scan_of_the_runs_table(store_url, name):
    read, index = READS[name]
    ensure_schema(store_url)
    with engine_for(store_url).connect() as conn, conn.begin() as transaction:
        _fill(conn)
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
        plans = _plans(conn, read)
        transaction.rollback()
    for plan in plans:
        lines = plan.splitlines()
        assert "SCAN durable_runs" not in lines, plan  # SQLite: the table read row by row
        assert not any("Seq Scan on durable_runs" in line for line in lines), plan
    assert any(index in plan for plan in plans), plans
