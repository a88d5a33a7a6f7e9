"""Per-step checkpoint overhead and durable-task throughput, on PostgreSQL and SQLite, in one run.

    /work/venv/bin/python benchmarks/step_bench.py [--steps 10000] [--tasks 1000]

Step overhead: one durable run doing N steps of a trivial function, minus the
same function called N times bare, per step; plus the replay of those N steps
(a redelivered run) and the SQL statements each new step sent. Throughput: N
runs of a durable task with 3 steps against a plain Celery task calling the
same 3 functions, both executed in-process through Celery's tracer
(``Task.apply``), so the broker is out of the ratio and the store is all that
differs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
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


def work(i: int) -> int:
    return i + 1


def bench_store(kind: str, url: str, steps: int, tasks: int) -> dict[str, Any]:
    app = Celery(f"bench-{kind}", broker="memory://")
    celery_durable.install(app)
    app.conf.update(durable_database_url=url, task_ignore_result=True, task_store_eager_result=False)
    statements = {"n": 0}

    @app.durable_task(bind=True, shared=False, name=f"bench.many_{kind}")
    def many(self: Any, n: int) -> int:
        for i in range(n):
            self.step("s", work, i)
        return n

    @app.durable_task(bind=True, shared=False, name=f"bench.three_{kind}")
    def durable3(self: Any, i: int) -> int:
        return self.step("a", work, i) + self.step("b", work, i) + self.step("c", work, i)

    @app.task(shared=False, name=f"bench.plain_{kind}")
    def plain3(i: int) -> int:
        return work(i) + work(i) + work(i)

    def _count(*_: Any) -> None:
        statements["n"] += 1

    durable3.apply((0,), task_id=f"warm-{uuid.uuid4()}")  # migrate, connect, compile statements
    started = time.perf_counter()
    for i in range(steps):
        work(i)
    bare = time.perf_counter() - started

    # The statements of N new steps, counted in a run of their own: while a cursor listener is
    # attached, a run's statements go through SQLAlchemy's execution (store/driver_sql.py), which the
    # timed runs must not pay.
    listened = (engine_for(url), autocommit(engine_for(url)))  # a run's statements run in autocommit
    for engine in listened:
        event.listen(engine, "before_cursor_execute", _count)
    statements["n"] = 0
    assert many.apply((steps,), task_id=f"counted-{uuid.uuid4()}").successful()
    new_statements = statements["n"]
    for engine in listened:
        event.remove(engine, "before_cursor_execute", _count)

    # First execution: N new steps, one INSERT each.
    run_id = f"many-{uuid.uuid4()}"
    t0 = time.perf_counter()
    result = many.apply((steps,), task_id=run_id)
    first = time.perf_counter() - t0
    assert result.successful(), result.traceback
    # A redelivery of the same run (reopened): every step is a dict lookup.
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE durable_runs SET state = 'failed' WHERE id = :r"), {"r": run_id})
    t0 = time.perf_counter()
    many.apply((steps,), task_id=run_id)
    replay = time.perf_counter() - t0

    ids = [f"t-{uuid.uuid4()}" for _ in range(tasks)]
    t0 = time.perf_counter()
    for task_id in ids:
        durable3.apply((1,), task_id=task_id)
    durable_rate = tasks / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for task_id in ids:
        plain3.apply((1,), task_id=task_id)
    plain_rate = tasks / (time.perf_counter() - t0)
    return {
        "kind": kind,
        "bare_us": bare / steps * 1e6,
        "step_us": (first - bare) / steps * 1e6,
        "replay_us": (replay - bare) / steps * 1e6,
        # A new run's start (one upsert) and settle are 2 statements; the rest are the steps.
        "statements_per_step": (new_statements - 2) / steps,
        "durable_per_s": durable_rate,
        "plain_per_s": plain_rate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--tasks", type=int, default=1_000)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("postgresql", "sqlite"):
            with fresh_store(kind, Path(tmp)) as url:
                rows.append(bench_store(kind, url, args.steps, args.tasks))
                dispose_all()
    print(f"steps={args.steps} tasks={args.tasks} (3 steps each)")
    print("| store | new step, µs (overhead over bare) | replayed step, µs | SQL statements per new step "
          "| durable tasks/s | plain tasks/s | durable/plain |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['step_us']:.0f} | {r['replay_us']:.1f} | {r['statements_per_step']:.2f} "
              f"| {r['durable_per_s']:.0f} | {r['plain_per_s']:.0f} | {r['durable_per_s'] / r['plain_per_s']:.2f} |")
    print(f"bare call: {rows[0]['bare_us']:.2f} µs")


if __name__ == "__main__":
    main()
