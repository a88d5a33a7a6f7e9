"""The CPU a new durable run costs the process that runs it, on PostgreSQL and SQLite: durable3 against plain3.

    .venv/bin/python benchmarks/run_cpu_bench.py [--runs 1500] [--rounds 3] [--store both]

Both tasks run as a pool child runs them (Celery's tracer on a delivered
request, not eager), one after the other in each round, in one process and
without a broker: ``durable3`` makes three trivial calls as checkpointed
steps, ``plain3`` the same calls bare. Printed per store: the wall time of a
durable3 run, and the CPU time (this process's, ``time.process_time``) a
durable3 run costs beyond a plain3 run — on SQLite the store's own work is in
it (in-process), on PostgreSQL only the client's. On PostgreSQL, when the
server runs on this host, also the CPU its backends (the processes serving
this process's connections, read from /proc) spent per durable3 run: the
other half of a run's price on a machine whose cores the workers share with
the database. Compare checkouts by running each in turn, alternated, at the
same load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from celery import Celery
from celery.app.trace import build_tracer
from sqlalchemy import event
from sqlalchemy.pool import Pool

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import celery_durable
from celery_durable.store.engine import dispose_all, ensure_schema
from tests.stores import fresh_store
from worker_bench import proc_cpu_seconds

app = Celery("run-cpu", broker="memory://")
celery_durable.install(app)
app.conf.task_ignore_result = True


def unit(i: int) -> int:
    return i + 1


@app.task(name="run_cpu.plain3")
def plain3(i: int) -> int:
    return unit(i) + unit(i) + unit(i)


@app.durable_task(bind=True, name="run_cpu.durable3")
def durable3(self: Any, i: int) -> int:
    return self.step("a", unit, i) + self.step("b", unit, i) + self.step("c", unit, i)


#: The PostgreSQL backend process of every connection this process opened (pg_backend_pid()).
backend_pids: set[int] = set()


@event.listens_for(Pool, "connect")
def _note_backend_pid(dbapi_connection: Any, _record: Any) -> None:
    if type(dbapi_connection).__module__.startswith("psycopg2"):
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            backend_pids.add(cursor.fetchone()[0])
        dbapi_connection.commit()


def backends_cpu() -> float | None:
    """Seconds of CPU (user + system) the live backends in ``backend_pids`` have used; None if none is on this host."""
    live = [pid for pid in backend_pids if _is_postgres(pid)]
    return sum(proc_cpu_seconds(pid) for pid in live) if live else None


def _is_postgres(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "postgres"
    except OSError:
        return False  # closed since (schema set-up's connections), or a server on another host


def timed(task: Any, runs: int) -> tuple[float, float]:
    """µs per run of ``task`` delivered ``runs`` times: (wall, CPU)."""
    tracer = build_tracer(task.name, task, eager=False, propagate=True, app=app)
    delivered = {"delivery_info": {"routing_key": "celery"}, "is_eager": False, "timelimit": (None, None)}
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(runs):
        task_id = uuid.uuid4().hex
        tracer(task_id, [i], {}, {**delivered, "id": task_id})
    return (time.perf_counter() - wall) / runs * 1e6, (time.process_time() - cpu) / runs * 1e6


def bench(url: str, runs: int, rounds: int) -> str:
    app.conf.durable_database_url = url
    ensure_schema(url)
    timed(durable3, 50), timed(plain3, 50)  # compiled, connected, warmed
    walls, extra, server = [], [], []
    for _ in range(rounds):
        _, plain_cpu = timed(plain3, runs)
        server_before = backends_cpu()
        wall, cpu = timed(durable3, runs)
        server_after = backends_cpu()
        walls.append(wall)
        extra.append(cpu - plain_cpu)
        if server_before is not None and server_after is not None:
            server.append((server_after - server_before) / runs * 1e6)
    line = (f"durable3 wall {statistics.median(walls):.0f} µs/run; CPU beyond plain3 "
            f"**{statistics.median(extra):.0f}** µs/run (rounds: {', '.join(f'{x:.0f}' for x in extra)})")
    if server:
        line += (f"; server backends' CPU **{statistics.median(server):.0f}** µs/run "
                 f"(rounds: {', '.join(f'{x:.0f}' for x in server)})")
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--store", choices=("both", "postgresql", "sqlite"), default="both")
    args = parser.parse_args()
    for kind in ("sqlite", "postgresql") if args.store == "both" else (args.store,):
        with tempfile.TemporaryDirectory() as tmp, fresh_store(kind, Path(tmp)) as url:
            print(f"{kind}: {bench(url, args.runs, args.rounds)}", flush=True)
            dispose_all()
            backend_pids.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
