"""What a fleet limit costs: a limited task beside the same task unlimited, handoff latency, broker ops per wait.

    .venv/bin/python benchmarks/limits_bench.py [--tasks 600] [--handoffs 200] [--waiting 500] [--write PATH]

All through real ``-P durable`` workers (tests/e2e/limitsapp.py) on Redis with a
PostgreSQL store (a fresh schema per measurement):

1. **Cost per run.** ``limits.export`` (``durable_concurrency=3``) against
   ``limits.export_free`` (the same task, no limit) on one worker ``-c 3`` — the limit never binds, so
   the difference is the gate's store transaction and the release. Both drain
   the same pre-loaded queue; the figure is the extra wall time per run, and the
   ratio of the two rates. The statements per run are counted in this process
   on the same code path (take a lease, give it back).
2. **Handoff latency.** ``limits.sync_plain`` with one key (limit 1): the time
   from one run's end to the next one's start, p50/p99, with the next waiting
   in the store (published again when the lease frees).
3. **Broker operations per waiting message.** Redis commands (``INFO
   commandstats``) while N messages of one key wait and then run, against N
   messages of an unlimited task, per message.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis
import sqlalchemy as sa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from celery_durable.clock import SYSTEM_CLOCK  # noqa: E402
from celery_durable.planning.limit_declarations import Scope  # noqa: E402
from celery_durable.planning.limits import WAIT, LimitAsk  # noqa: E402
from celery_durable.store import limit_waiting  # noqa: E402
from celery_durable.store import limits as limit_store  # noqa: E402
from celery_durable.store.engine import autocommit, dispose_all, engine_for, ensure_schema  # noqa: E402
from tests.e2e.harness import Scenario, wait_for  # noqa: E402
from tests.services import broker_url  # noqa: E402
from tests.stores import fresh_store  # noqa: E402

now = SYSTEM_CLOCK.now

APP = "tests.e2e.limitsapp"


def _scenario() -> Scenario:
    return Scenario("redis", broker_url("redis"), ["q"])


def drain_rate(task: str, tasks: int, url: str) -> float:
    """Runs per second of one ``-c 3`` worker draining ``tasks`` pre-loaded messages."""
    s = _scenario()
    try:
        for i in range(tasks):
            s.send_task("q", task, [f"x{i}", 0.0])
        worker = s.worker(app=APP, conf={"durable_database_url": url}, queues=["q"], concurrency=3)
        worker.wait_ready()
        # Counting the tasks' records, not reading them: the benchmark's own polling must not
        # compete with the worker for the CPU (each run records a start and an end).
        wait_for(lambda: s.observer.llen(s.key) >= 2 * tasks, timeout=300, what="the queue to drain", every=0.1)
        events = s.events()
        first = min(e["t"] for e in events if e["e"] == "start")
        last = max(e["t"] for e in events if e["e"] == "end")
        return tasks / (last - first)
    finally:
        s.cleanup()


def statements_per_run(url: str) -> tuple[int, int]:
    """Statements the gate sends per run on PostgreSQL, counted here on its code path.

    Returns (fast, general): a run that fits takes its leases in one call that
    also gives back the leases of the run that ended before it (the steady
    state of a busy worker); the general transaction (a busy scope, waiters)
    takes and releases with several statements each, BEGIN and COMMIT included.
    """
    engine = engine_for(url)
    counted: list[str] = []
    for counting in (engine, autocommit(engine)):
        sa.event.listen(counting, "before_cursor_execute", lambda *a, **k: counted.append(a[2]))
    scope = Scope("bench", "task", "", 3)
    ask = LimitAsk("bench", "r1", (scope,), None, WAIT)
    with autocommit(engine).connect() as conn:
        limit_store.exchange(conn, [], [ask], holder="h", ttl=30.0, now=now())
        counted.clear()
        limit_store.exchange(conn, [limit_store.Return("bench", "r1", (scope,))],
                             [LimitAsk("bench", "r2", (scope,), None, WAIT)], holder="h", ttl=30.0, now=now())
    fast = len(counted)
    counted.clear()
    message = limit_waiting.WaitingMessage("r3", "q", "", "q", b"[]", "{}", "{}", "application/json", "utf-8")
    with engine.begin() as conn:
        limit_store.take_batch(conn, [LimitAsk("bench", "r3", (scope,), None, WAIT)], [message], holder="h",
                               ttl=30.0, now=now())
    with engine.begin() as conn:
        limit_store.release(conn, [limit_store.Return("bench", "r3", (scope,))], holder="h", ttl=30.0, now=now())
    # Each transaction's BEGIN (sent by psycopg2, not seen by SQLAlchemy's event) and COMMIT.
    return fast, len(counted) + 4


def handoffs(count: int, url: str) -> list[float]:
    s = _scenario()
    try:
        worker = s.worker(app=APP, conf={"durable_database_url": url}, queues=["q"], concurrency=4)
        worker.wait_ready()
        for i in range(count):
            s.send_task("q", "limits.sync_plain", ["one", f"h{i}", 0.0])
        wait_for(lambda: s.observer.llen(s.key) >= 2 * count, timeout=300, what="every handoff", every=0.1)
        runs = sorted((e for e in s.events() if e["label"].startswith("h")), key=lambda e: e["t"])
        gaps = []
        last_end = None
        for event in runs:
            if event["e"] == "end":
                last_end = event["t"]
            elif last_end is not None:
                gaps.append(event["t"] - last_end)
        return gaps
    finally:
        s.cleanup()


def broker_ops(task: str, count: int, url: str) -> float:
    """Redis commands per message while ``count`` messages (one key when limited) pass through."""
    s = _scenario()
    client = redis.Redis.from_url(broker_url("redis"))
    try:
        worker = s.worker(app=APP, conf={"durable_database_url": url}, queues=["q"], concurrency=4)
        worker.wait_ready()
        time.sleep(1.0)  # let the worker's start-up traffic settle before counting
        before = _commands(client)
        for i in range(count):
            args = ["one", f"w{i}", 0.0] if task == "limits.sync_plain" else [f"w{i}", 0.0]
            s.send_task("q", task, args)
        polls = 0

        def all_ran() -> bool:
            nonlocal polls
            polls += 1
            return bool(s.observer.llen(s.key) >= 2 * count)

        wait_for(all_ran, timeout=300, what="every message to run", every=0.1)
        # Not the worker's: the tasks' own records (start, end), the sends, and this process's polls.
        return (_commands(client) - before - 3 * count - polls) / count
    finally:
        s.cleanup()


def _commands(client: redis.Redis) -> int:
    return sum(int(stats["calls"]) for stats in client.info("commandstats").values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=600)
    parser.add_argument("--handoffs", type=int, default=200)
    parser.add_argument("--waiting", type=int, default=500)
    parser.add_argument("--write", type=Path)
    options = parser.parse_args()
    os.environ.setdefault("E2E_LOG_DIR", tempfile.mkdtemp(prefix="limits-bench-"))
    lines = ["# Fleet limits: cost, handoff, broker operations", "",
             f"`benchmarks/limits_bench.py --tasks {options.tasks} --handoffs {options.handoffs} "
             f"--waiting {options.waiting}` on {time.strftime('%Y-%m-%d')}; Redis broker, PostgreSQL store.", ""]
    with fresh_store("postgresql", Path(tempfile.mkdtemp())) as url:
        ensure_schema(url)
        fast_statements, general_statements = statements_per_run(url)
        rates: dict[str, list[float]] = {"unlimited": [], "limited": []}
        for _ in range(2):  # interleaved rounds
            rates["unlimited"].append(drain_rate("limits.export_free", options.tasks, url))
            rates["limited"].append(drain_rate("limits.export", options.tasks, url))
        unlimited = statistics.median(rates["unlimited"])
        limited = statistics.median(rates["limited"])
        # The gate's transactions run on the worker's loop thread, which every run passes through:
        # the drain's time per run is where their cost shows.
        extra_ms = (1 / limited - 1 / unlimited) * 1000
        gaps = sorted(handoffs(options.handoffs, url))
        with fresh_store("sqlite", Path(tempfile.mkdtemp())) as sqlite_url:
            ensure_schema(sqlite_url)
            sqlite_gaps = sorted(handoffs(options.handoffs, sqlite_url))
        waiting_ops = broker_ops("limits.sync_plain", options.waiting, url)
        plain_ops = broker_ops("e2e.record", options.waiting, url)
    dispose_all()
    p50, p99 = gaps[len(gaps) // 2] * 1000, gaps[int(len(gaps) * 0.99) - 1] * 1000
    sqlite_p50, sqlite_p99 = (sqlite_gaps[len(sqlite_gaps) // 2] * 1000,
                              sqlite_gaps[int(len(sqlite_gaps) * 0.99) - 1] * 1000)
    rounds = {name: ", ".join(f"{r:.0f}" for r in values) for name, values in rates.items()}
    lines += [
        "| measure | figure |", "|---|---|",
        f"| unlimited `limits.export_free`, -c 3 | {unlimited:.0f} runs/s (rounds: {rounds['unlimited']}) |",
        f"| `durable_concurrency=3`, never binding, -c 3 | {limited:.0f} runs/s (rounds: {rounds['limited']}) |",
        f"| limited / unlimited | {limited / unlimited:.2f}x |",
        f"| extra worker time per limited run (1/limited rate - 1/unlimited rate) | {extra_ms:.2f} ms |",
        f"| statements per run, PostgreSQL: the give-back of the run before and this run's take, one call "
        f"(autocommit) | {fast_statements} |",
        f"| statements per run by the general transaction (a busy scope, waiters; BEGIN and COMMIT counted) "
        f"| {general_statements} |",
        f"| handoff, one run's end to the next waiting run's start (one key, limit 1, {len(gaps)} handoffs) "
        f"| p50 {p50:.1f} ms, p99 {p99:.1f} ms |",
        f"| the same handoff on the embedded SQLite store (no NOTIFY: the freeing worker's own dispatcher) "
        f"| p50 {sqlite_p50:.1f} ms, p99 {sqlite_p99:.1f} ms |",
        f"| Redis commands per message, {options.waiting} waiting on one key | {waiting_ops:.1f} |",
        f"| Redis commands per message, {options.waiting} unlimited | {plain_ops:.1f} |",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if options.write:
        options.write.write_text(report)


if __name__ == "__main__":
    main()
