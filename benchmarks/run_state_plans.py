"""The plan and cost of every store query that reads ``durable_runs`` by state, on a store of many runs.

    .venv/bin/python benchmarks/run_state_plans.py [--runs 200000] [--store sqlite|postgresql|both]

Fills a store with ``--runs`` runs, nearly all of them ``succeeded`` (as a store between two retention
passes is), the rest live, sleeping, failed, dead or cancelled; then calls each store function that
names the state column, records the SQL it sent, and prints that SQL's plan (SQLite ``EXPLAIN QUERY
PLAN``, PostgreSQL ``EXPLAIN`` after ``ANALYZE``) and the call's time (best of 5). A plan that scans the
runs table where it used an index is what a change to ``ix_durable_runs_state`` must not bring.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from celery_durable.store import run_reads, runs
from celery_durable.store.engine import dispose_all, engine_for, ensure_schema
from celery_durable.store.schema import (
    CANCELLED,
    DEAD,
    FAILED,
    RUNNING,
    SLEEPING,
    SUCCEEDED,
)
from celery_durable.store.schema import runs as runs_table
from tests.stores import fresh_store

AT = datetime(2026, 12, 1, tzinfo=timezone.utc)
#: Of every 1,000 runs: the state of all but these few is ``succeeded``.
FEW = {RUNNING: 4, SLEEPING: 2, FAILED: 2, DEAD: 2, CANCELLED: 1}


def _state_of(i: int) -> str:
    slot = i % 1000
    for state, count in FEW.items():
        if slot < count:
            return state
        slot -= count
    return SUCCEEDED


def _row(i: int) -> dict[str, Any]:
    state = _state_of(i)
    at = AT + timedelta(milliseconds=i)
    settled = state in (SUCCEEDED, DEAD, CANCELLED)
    live = state == RUNNING
    return {"id": f"t-{i:08d}-{hash(i) & 0xffffffff:08x}", "task_name": "bench.three", "queue": "celery",
            "state": state, "attempts": 1, "args": f"[{i}]", "kwargs": "{}", "result": "6" if settled else None,
            "last_error": "Boom: no" if state in (DEAD, FAILED) else None, "started_at": at, "updated_at": at,
            "finished_at": at if settled else None, "lease_holder": f"tok-{i}" if live else None,
            "lease_expires_at": at + timedelta(hours=1) if live else None,
            "wake_at": at + timedelta(hours=1) if state == SLEEPING else None}


def fill(url: str, count: int) -> None:
    ensure_schema(url)
    with engine_for(url).begin() as conn:
        for start in range(0, count, 10_000):
            conn.execute(runs_table.insert(), [_row(i) for i in range(start, min(count, start + 10_000))])
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql("ANALYZE durable_runs")


def _reads(count: int) -> list[tuple[str, Callable[[Connection], Any]]]:
    late = AT + timedelta(milliseconds=count + 1)
    return [
        ("stranded", lambda c: runs.stranded(c, late + timedelta(hours=2), late, 100)),
        ("sleeping", lambda c: runs.sleeping(c, 50)),
        ("count_by_state", run_reads.count_by_state),
        ("dead_by_queue", run_reads.dead_by_queue),
        ("listed (no filter)", lambda c: run_reads.listed(c, limit=50)),
        ("listed [dead]", lambda c: run_reads.listed(c, states=[DEAD], limit=50)),
        ("listed [running, sleeping]", lambda c: run_reads.listed(c, states=[RUNNING, SLEEPING], limit=50)),
        ("listed [succeeded]", lambda c: run_reads.listed(c, states=[SUCCEEDED], limit=50)),
        ("listed [succeeded] since 1 min", lambda c: run_reads.listed(c, states=[SUCCEEDED], since=late - timedelta(
            minutes=1), limit=50)),
        ("renew", lambda c: runs.renew(c, {_row(0)["id"]: "tok-0"}, 60)),
        ("reopen (a dead run)", lambda c: runs.reopen(c, _row(9)["id"], late)),
        ("get", lambda c: runs.get(c, _row(0)["id"])),
    ]


def _purges() -> list[tuple[str, Callable[[Connection], Any]]]:
    # Retention: its default states, and dead runs alone (an operator's ``--state dead``).
    return [
        ("purge_settled [succeeded, cancelled], nothing old enough",
         lambda c: runs.purge_settled(c, AT - timedelta(days=1), [SUCCEEDED, CANCELLED], 500)),
        ("purge_settled [succeeded, cancelled], 500 of them",
         lambda c: runs.purge_settled(c, AT + timedelta(days=1), [SUCCEEDED, CANCELLED], 500)),
        ("purge_settled [dead], 500 of them", lambda c: runs.purge_settled(c, AT + timedelta(days=1), [DEAD], 500)),
    ]


def _explain(conn: Connection, statement: str, params: Any) -> list[str]:
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    if conn.dialect.name == "sqlite":
        cursor.execute(f"EXPLAIN QUERY PLAN {statement}", params)
        return [str(row[3]) for row in cursor.fetchall()]
    cursor.execute(f"EXPLAIN {statement}", params)
    return [row[0] for row in cursor.fetchall()]


def _show(conn: Connection, name: str, call: Callable[[Connection], Any], rollback: bool) -> None:
    sent: list[tuple[str, Any]] = []

    def record(_c: Any, _cursor: Any, statement: str, params: Any, _ctx: Any, _many: bool) -> None:
        if not statement.lstrip().upper().startswith(("EXPLAIN", "SELECT CURRENT", "SELECT NOW", "SELECT STRFTIME",
                                                      "SELECT DATETIME", "SELECT JULIANDAY")):
            sent.append((statement, params))

    best = float("inf")
    for attempt in range(5):
        event.listen(conn, "before_cursor_execute", record)
        transaction = conn.begin()
        began = time.perf_counter()
        call(conn)
        best = min(best, time.perf_counter() - began)
        event.remove(conn, "before_cursor_execute", record)
        if attempt == 0:
            print(f"\n== {name}: ", end="")
            plans = [(statement, _explain(conn, statement, params)) for statement, params in sent]
        (transaction.rollback if rollback else transaction.commit)()
    print(f"{best * 1000:.2f} ms (best of 5)")
    for statement, plan in plans:
        print("   " + " ".join(statement.split())[:160])
        for line in plan:
            print(f"     | {line[:150]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200_000)
    parser.add_argument("--store", choices=("sqlite", "postgresql", "both"), default="both")
    args = parser.parse_args()
    kinds = ("sqlite", "postgresql") if args.store == "both" else (args.store,)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            with fresh_store(kind, Path(tmp)) as url:
                fill(url, args.runs)
                print(f"\n######## {kind}: {args.runs} runs, {sum(FEW.values()) / 10:.1f}% of them not succeeded")
                with engine_for(url).connect() as conn:
                    for name, call in _reads(args.runs):
                        _show(conn, name, call, rollback=True)
                    for name, call in _purges():
                        _show(conn, name, call, rollback=True)
                dispose_all()


if __name__ == "__main__":
    main()
