"""DBOS Transact running the 3-step workflow of ``durable_task_bench.py`` through its own queue, same PostgreSQL.

DBOS is not a dependency of this project: run it with a scratch venv where ``pip install dbos`` works.

    /tmp/dbos-venv/bin/python benchmarks/dbos_task_bench.py [--tasks 2000] [--rounds 3] [--concurrency 2]

A workflow makes three calls of the same trivial function as ``bench.durable3``,
each a ``@DBOS.step``; N workflows are enqueued on a DBOS queue (system schema of
its own in the ``test`` database, dropped afterwards), then DBOS is launched in
this process with ``worker_concurrency`` workers; workflows/s runs from the first
step's start to the last workflow's end, like the Celery figures. DBOS runs its
queue on threads of one process, so the comparison is with the ``durable
threads`` worker more than with prefork.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Sequence

import sqlalchemy as sa
from dbos import DBOS, DBOSConfig, Queue

BASE_URL = "postgresql://postgres@127.0.0.1:5432/test"

_lock = threading.Lock()
_first: list[float] = []
_last: list[float] = []


def _unit(i: int) -> int:
    return i * 2 + 1


@DBOS.step()
def unit_step(i: int) -> int:
    return _unit(i)


@DBOS.workflow()
def durable3(i: int) -> int:
    started = time.time()
    total = unit_step(i) + unit_step(i) + unit_step(i)
    with _lock:
        _first.append(started)
        _last.append(time.time())
    return total


def one_round(queue: Queue, count: int) -> float:
    _first.clear()
    _last.clear()
    handles = [queue.enqueue(durable3, i) for i in range(count)]
    for handle in handles:
        handle.get_result()
    return count / (max(_last) - min(_first))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args(argv)
    schema = f"dbos_bench_{uuid.uuid4().hex[:8]}"
    config: DBOSConfig = {"name": "durable-price-bench", "system_database_url": BASE_URL,
                          "dbos_system_schema": schema, "log_level": "WARNING"}
    DBOS(config=config)
    DBOS.launch()
    queue = DBOS.register_queue("bench", worker_concurrency=args.concurrency, polling_interval_sec=0.01)
    rates = []
    try:
        for n in range(args.rounds):
            rate = one_round(queue, args.tasks)
            rates.append(rate)
            print(f"  round {n + 1}: DBOS durable3 ({args.concurrency} workers, threads) {rate:,.0f} workflows/s",
                  flush=True)
    finally:
        DBOS.destroy()
        admin = sa.create_engine(BASE_URL.replace("postgresql://", "postgresql+psycopg://"),
                                 isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        admin.dispose()
    print(f"DBOS durable3: median {statistics.median(rates):,.0f} workflows/s over {args.rounds} round(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
