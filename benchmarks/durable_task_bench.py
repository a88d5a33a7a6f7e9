"""Durable-task throughput through real workers and a real broker, beside a plain task doing the same work.

    /work/venv/bin/python benchmarks/durable_task_bench.py [--broker redis|rabbitmq|all]
                                                           [--tasks 2000] [--rounds 2] [--write PATH]
                                                           [--worker LABEL ...]

``bench.plain3`` calls a trivial function three times; ``bench.durable3`` makes the
same three calls as checkpointed steps (``self.step``). Both tally their start and
end in Redis with one Lua call (benchapp). For each worker (``-P durable`` threads
-c8, ``-P durable`` prefork -c2, stock prefork -c2 — a durable task runs under any
pool) N tasks are pre-loaded and the worker started; tasks/s runs from the first
task's start to the last task's end. The durable task runs once per store
(PostgreSQL in a fresh schema, SQLite in a temp file; the schema is migrated before
the worker starts), so ``durable / plain`` is the whole price of durability — run
row, checkpoint load, three step INSERTs, settle — through the same worker, broker
and tally. Rounds are interleaved; the median is reported.

Before the workers, the same task is applied in this process against each store,
and the statements and round trips to the store per run are counted
(``store_round_trips.py`` says what is counted): a new run, and a run resumed
after its attempt died with its three checkpoints taken.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from celery_durable.store.engine import dispose_all, ensure_schema  # noqa: E402
from store_round_trips import Tally, per_run  # noqa: E402
from tests.stores import fresh_store  # noqa: E402
from worker_bench import Broker, Variant, run_throughput, write_report  # noqa: E402

WORKERS = [
    Variant("durable threads -c8", "durable", 8, {"durable_execution": "threads", "durable_max_in_flight": 8}),
    Variant("durable prefork -c2", "durable", 2, {"durable_max_in_flight": 2}),
    Variant("stock prefork -c2", "prefork", 2),
]
STORES = ("postgresql", "sqlite")


def measure(broker: Broker, variant: Variant, task: str, count: int) -> float:
    figures = run_throughput(broker, variant, count, task=task, extra_args=lambda i: [i])
    return figures["rate"]


def count_round_trips(store_dir: Path, runs: int) -> list[str]:
    """Statements and round trips per run on each store, as markdown lines (also printed)."""
    os.environ.setdefault("BENCH_BROKER", "memory://")
    import benchapp

    lines = ["| store | run | statements / run | round trips / run | commits waiting for the WAL flush / run "
             "| statements in order | compiled cache |", "|---|---|---|---|---|---|---|"]
    tally_fn = benchapp._tally
    benchapp._tally = lambda key, started: None  # the Redis tally is the workers' figure, not the store's
    try:
        for store in STORES:
            with fresh_store(store, store_dir) as url:
                figures = per_run(benchapp.app, benchapp.durable3, url, runs)
                dispose_all()
            for kind, tally in figures.items():
                lines.append(_count_row(store, kind, tally, runs))
    finally:
        benchapp._tally = tally_fn
    for line in lines:
        print(line, flush=True)
    return lines


def _count_row(store: str, kind: str, tally: Tally, runs: int) -> str:
    order = ", ".join(dict.fromkeys(tally.sql))
    cache = ", ".join(f"{name} {count}" for name, count in sorted(tally.cache.items()))
    flushes = f"**{tally.flush_waits / runs:.2f}**" if store == "postgresql" else "none (WAL, synchronous=NORMAL)"
    return (f"| {store} | {kind} | {tally.statements / runs:.2f} | **{tally.round_trips / runs:.2f}** "
            f"(BEGIN {tally.begins}, COMMIT {tally.commits}, ROLLBACK {tally.rollbacks} in {runs} runs) "
            f"| {flushes} | {order} | {cache} |")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker", choices=["redis", "rabbitmq", "all"], default="redis")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--write", metavar="PATH", help="also write the table (markdown) to PATH")
    parser.add_argument("--worker", action="append", choices=[w.label for w in WORKERS],
                        help="only this worker (repeatable; default: all)")
    parser.add_argument("--count-runs", type=int, default=50,
                        help="runs applied in this process per store to count round trips (0: skip)")
    args = parser.parse_args(argv)
    kinds = ["redis", "rabbitmq"] if args.broker == "all" else [args.broker]
    log_dir = Path(tempfile.mkdtemp(prefix="durable-task-bench-"))
    started = time.monotonic()
    print(f"worker logs: {log_dir}", flush=True)
    workers = [w for w in WORKERS if not args.worker or w.label in args.worker]
    count_lines: list[str] = []
    if args.count_runs:
        with tempfile.TemporaryDirectory() as count_dir:
            count_lines = count_round_trips(Path(count_dir), args.count_runs)

    # (broker, worker label, task label) -> rates over rounds
    rates: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as store_dir:
        for kind in kinds:
            broker = Broker(kind, log_dir)
            problem = broker.check()
            if problem is not None:
                print(f"{kind}: not reachable ({problem})", file=sys.stderr)
                return 1
            for _ in range(args.rounds):
                for variant in workers:
                    cases: list[tuple[str, str, Variant]] = [("plain3", "bench.plain3", variant)]
                    for store in STORES:
                        cases.append((f"durable3 on {store}", "bench.durable3", variant))
                    for label, task, v in cases:
                        if task == "bench.durable3":
                            store = label.rsplit(" ", 1)[1]
                            with fresh_store(store, Path(store_dir)) as url:
                                ensure_schema(url)
                                dispose_all()
                                v = replace(v, conf={**v.conf, "durable_database_url": url})
                                rate = measure(broker, v, task, args.tasks)
                        else:
                            rate = measure(broker, v, task, args.tasks)
                        rates.setdefault((kind, variant.label, label), []).append(rate)
                        print(f"  {kind:<8} {variant.label:<22} {label:<22} {rate:,.0f} tasks/s", flush=True)

    lines = [f"{args.tasks:,} tasks per case, median of {args.rounds} interleaved round(s); tasks/s first start "
             "→ last end", "",
             "| broker | worker | plain3 tasks/s | durable3 on PostgreSQL | durable / plain | durable3 on SQLite "
             "| durable / plain |", "|---|---|---|---|---|---|---|"]
    for kind in kinds:
        for variant in workers:
            plain = statistics.median(rates[(kind, variant.label, "plain3")])
            cells = [kind, variant.label, f"{plain:,.0f}"]
            for store in STORES:
                durable = statistics.median(rates[(kind, variant.label, f"durable3 on {store}")])
                cells += [f"{durable:,.0f}", f"**{durable / plain:.2f}×**"]
            lines.append("| " + " | ".join(cells) + " |")
    if count_lines:
        lines += ["", f"Store statements and round trips per run ({args.count_runs} runs applied in the "
                  "benchmark's process, per store; see `store_round_trips.py`):", "", *count_lines]
    report = "\n".join(lines)
    elapsed = time.monotonic() - started
    print()
    print(report)
    print(f"(total {elapsed:.0f} s)")
    if args.write:
        write_report(Path(args.write), "Durable-task throughput through real workers", "durable_task_bench.py",
                     argv, [f"- machine: {os.cpu_count()} cores; brokers and databases local; "
                            f"total run {elapsed:.0f} s"], report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
