"""What one new 3-step durable run writes: SQLite WAL frames (by table and index), PostgreSQL WAL bytes.

    .venv/bin/python benchmarks/run_pages.py [--runs 200] [--store sqlite|postgresql|both]

Runs go through Celery's tracer in-process (``Task.apply``), as in ``step_bench.py``: a start, three
checkpoints and a settle, each its own commit, exactly as under a worker. SQLite: with automatic
checkpoints off, every frame appended to the WAL is one page written by one commit; each frame's page
number is mapped to the B-tree it belongs to (``dbstat``), so the count says which table or index
costs what. A count of frames, unlike a rate, does not move with the machine's load. PostgreSQL:
``pg_current_wal_lsn()`` before and after (the only writer on its test database, minus background noise).
"""

from __future__ import annotations

import argparse
import collections
import sqlite3
import struct
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from celery import Celery
from sqlalchemy import event

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import celery_durable
from celery_durable.store.engine import autocommit, dispose_all, engine_for
from tests.stores import fresh_store

WAL_HEADER, FRAME_HEADER = 32, 24


#: Characters in each step's result (``--result-bytes``); 0: the step returns an integer.
RESULT_BYTES = 0


def work(i: int) -> int | str:
    return "x" * RESULT_BYTES + str(i) if RESULT_BYTES else i + 1


def _app(kind: str, url: str) -> Any:
    app = Celery(f"pages-{kind}", broker="memory://")
    celery_durable.install(app)
    app.conf.update(durable_database_url=url, task_ignore_result=True, task_store_eager_result=False)

    @app.durable_task(bind=True, shared=False, name=f"pages.three_{kind}")
    def durable3(self: Any, i: int) -> int:
        return self.step("a", work, i) + self.step("b", work, i) + self.step("c", work, i)

    return durable3


def _run(task: Any, n: int) -> None:
    for i in range(n):
        result = task.apply((i,), task_id=f"t-{uuid.uuid4()}")
        if not result.successful():
            raise RuntimeError(result.traceback)


def sqlite_frames(url: str, runs: int, warm: int) -> tuple[float, dict[str, float]]:
    """WAL frames per run, and per B-tree (table or index) per run."""
    def no_auto_checkpoint(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.execute("PRAGMA wal_autocheckpoint=0")

    for engine in (engine_for(url), autocommit(engine_for(url))):
        event.listen(engine, "connect", no_auto_checkpoint)
    task = _app("sqlite", url)
    _run(task, warm)  # migrate, connect, and grow the B-trees to a steady state (splits, interior pages)
    path = Path(sa.engine.make_url(url).database or "")
    wal = Path(f"{path}-wal")
    # A plain connection of its own: the store's engines wrap every use in BEGIN IMMEDIATE.
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page_size = int(raw.execute("PRAGMA page_size").fetchone()[0])
    before = wal.stat().st_size
    _run(task, runs)
    data = wal.read_bytes()
    start = max(before, WAL_HEADER)
    frames = (len(data) - start) // (page_size + FRAME_HEADER)
    pages = [struct.unpack(">I", data[start + f * (page_size + FRAME_HEADER):][:4])[0] for f in range(frames)]
    raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    owner = dict(raw.execute("SELECT pageno, name FROM dbstat").fetchall())
    raw.close()
    counts = collections.Counter(owner.get(page, "(header/freelist)") for page in pages)
    return frames / runs, {name: count / runs for name, count in counts.most_common()}


def postgresql_wal_bytes(url: str, runs: int, warm: int) -> float:
    task = _app("postgresql", url)
    _run(task, warm)
    with engine_for(url).connect() as conn:
        before = conn.exec_driver_sql("SELECT pg_current_wal_insert_lsn()").scalar_one()
    _run(task, runs)
    with engine_for(url).connect() as conn:
        grown = conn.exec_driver_sql(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %(b)s::pg_lsn)", {"b": before}).scalar_one()
    return float(grown) / runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--warm", type=int, default=2000, help="runs made first, not counted")
    parser.add_argument("--result-bytes", type=int, default=0, help="each step returns a string this long")
    parser.add_argument("--store", choices=("sqlite", "postgresql", "both"), default="both")
    args = parser.parse_args()
    global RESULT_BYTES
    RESULT_BYTES = args.result_bytes
    results = f"step results of {RESULT_BYTES} characters" if RESULT_BYTES else "integer step results"
    with tempfile.TemporaryDirectory() as tmp:
        if args.store in ("sqlite", "both"):
            with fresh_store("sqlite", Path(tmp)) as url:
                per_run, by_tree = sqlite_frames(url, args.runs, args.warm)
                dispose_all()
            print(f"SQLite: {per_run:.2f} WAL frames (pages written) per new 3-step run, over {args.runs} runs "
                  f"after {args.warm}; {results}")
            for name, count in by_tree.items():
                print(f"  {name}: {count:.2f}")
        if args.store in ("postgresql", "both"):
            with fresh_store("postgresql", Path(tmp)) as url:
                per_run_bytes = postgresql_wal_bytes(url, args.runs, args.warm)
                dispose_all()
            print(f"PostgreSQL: {per_run_bytes:.0f} WAL bytes per new 3-step run, over {args.runs} runs "
                  f"after {args.warm}; {results}")


if __name__ == "__main__":
    main()
