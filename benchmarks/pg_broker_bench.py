"""The PostgreSQL broker's transport alone, through kombu's API: publish, claim + ack, idle pickup latency.

    .venv/bin/python benchmarks/pg_broker_bench.py [--messages 20000] [--batch 500] [--singles 2000] [--latency 200]

PostgreSQL 127.0.0.1:5432 (``DURABLE_TEST_POSTGRES_URL``), a fresh schema per run, one process:
- batch publish: ``messages`` prepared kombu messages, ``basic_publish_many`` in batches of ``batch``
  (one INSERT each): messages/s;
- single publish: ``singles`` × ``Producer.publish`` (one INSERT, autocommit, each): messages/s;
- claim + ack: a consumer (prefetch 100: one claim statement takes up to 100 rows) drains the
  ``messages`` rows, acking each (the acks deleted in one statement per batch): messages/s;
- idle pickup: ``latency`` messages published one at a time to an idle consumer waiting in
  ``drain_events`` with a 10 s polling interval (only a NOTIFY explains a fast pickup):
  p50 / p99 of delivery - publish.

``--workers N`` adds real workers (``benchmarks/benchapp.py``, Redis 127.0.0.1:6379 for the tally):
N no-op tasks pre-loaded, then one ``celery worker -P durable`` starts; tasks/s from the first
task's start to the last one's end, side by side in one run: on Redis, on this broker with one
queue, and on this broker with the work on the last of 200 queues (prefork -c 2 and threads -c 8);
``--rounds R`` runs every side once per round, back to back (interleaved, each round starting with
another side, the broker's table vacuumed before each side on it, the load printed);
``--pickups N`` adds a ``-P durable`` worker's idle pickup (N pings, p50 of start - send, and of start -
the publish's return) on Redis and on this broker each round; the claim statements one pass over 200
queues sends are counted on the engine and printed. ``--workers-only`` skips the transport-alone figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import sqlalchemy as sa
from kombu import Connection, Exchange, Queue

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from celery_durable.broker import register, rows
from celery_durable.store.engine import dispose_all, ensure_schema
from tests.services import POSTGRES_URL


def _queue(name: str) -> Queue:
    return Queue(name, Exchange(name), name)


def batch_publish(conn: Connection, messages: int, batch: int) -> float:
    channel = conn.default_channel
    _queue("bulk")(channel).declare()
    body = channel.encode_body('{"task": "noop", "args": []}')[0]
    started = time.perf_counter()
    for first in range(0, messages, batch):
        prepared = [channel.prepare_message(body, content_type="application/json", content_encoding="utf-8")
                    for _ in range(min(batch, messages - first))]
        channel.basic_publish_many(prepared, "bulk", "bulk")
    return messages / (time.perf_counter() - started)


def single_publish(conn: Connection, singles: int) -> float:
    producer = conn.Producer()
    queue = _queue("single")
    producer.publish({"n": 0}, exchange=queue.exchange, routing_key="single", declare=[queue])
    started = time.perf_counter()
    for n in range(singles):
        producer.publish({"n": n}, exchange=queue.exchange, routing_key="single")
    return singles / (time.perf_counter() - started)


def claim_and_ack(conn: Connection, messages: int) -> float:
    done = 0

    def on_message(body: object, message: object) -> None:
        nonlocal done
        message.ack()  # type: ignore[attr-defined]
        done += 1

    with conn.Consumer(_queue("bulk"), callbacks=[on_message], prefetch_count=100):
        started = time.perf_counter()
        while done < messages:
            conn.drain_events(timeout=5)
        return messages / (time.perf_counter() - started)


def pickup_latency(url: str, samples: int) -> tuple[float, float]:
    queue = _queue("idle")
    delays: list[float] = []
    got = threading.Event()
    with Connection(url) as consumer_conn, Connection(url) as producer_conn:
        consumer_conn.transport.polling_interval = 10.0
        producer = producer_conn.Producer()
        producer.publish({"warm": True}, exchange=queue.exchange, routing_key="idle", declare=[queue])

        def on_message(body: dict[str, float], message: object) -> None:
            if "sent" in body:
                delays.append(time.perf_counter() - body["sent"])
                got.set()
            message.ack()  # type: ignore[attr-defined]

        with consumer_conn.Consumer(queue, callbacks=[on_message]):
            consumer_conn.drain_events(timeout=5)  # the warm-up message
            stop = threading.Event()

            def consume() -> None:
                while not stop.is_set():
                    try:
                        consumer_conn.drain_events(timeout=0.5)
                    except TimeoutError:
                        pass

            thread = threading.Thread(target=consume)
            thread.start()
            try:
                for _ in range(samples):
                    got.clear()
                    time.sleep(0.02)  # the consumer is back waiting on LISTEN
                    producer.publish({"sent": time.perf_counter()}, exchange=queue.exchange, routing_key="idle")
                    if not got.wait(5):
                        raise RuntimeError("a message was not picked up within 5 s")
            finally:
                stop.set()
                thread.join()
    delays.sort()
    return statistics.median(delays) * 1000, delays[int(len(delays) * 0.99) - 1] * 1000


WORKER_VARIANTS = (
    ("durable prefork -c2", ["-P", "durable", "-c", "2"], {"durable_max_in_flight": 2}),
    ("durable threads -c8", ["-P", "durable", "-c", "8"], {"durable_execution": "threads",
                                                           "durable_max_in_flight": 8}),
)
OBSERVE_URL = os.environ.get("DURABLE_TEST_OBSERVE_URL", "redis://127.0.0.1:6379/15")
REDIS_URL = os.environ.get("DURABLE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@contextmanager
def _worker(broker_url: str, queues: list[str], argv: list[str], conf: dict[str, object],
            key: str) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """One ``celery worker`` of benchapp on ``queues``, its log in /tmp; terminated on the way out."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ, BENCH_BROKER=broker_url, BENCH_QUEUES=",".join(queues), BENCH_CONF=json.dumps(conf),
               BENCH_OBSERVE=OBSERVE_URL,
               PYTHONPATH=os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")]))
    log = Path("/tmp") / f"pg-bench-{key.rsplit(':', 1)[1][:8]}.log"
    with open(log, "wb") as out:
        # PG_BENCH_PROFILE=DIR: the worker's main process (its hub thread: claims, admission) under cProfile.
        profile_dir = os.environ.get("PG_BENCH_PROFILE")
        profiler = ["-m", "cProfile", "-o", str(Path(profile_dir) / f"{log.stem}.prof")] if profile_dir else []
        worker = subprocess.Popen([sys.executable, *profiler, "-m", "celery", "-A", "benchapp", "worker", *argv,
                                   "-Q", ",".join(queues), "--without-mingle", "--without-gossip",
                                   "-l", "warning"], cwd=here, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield worker, log
    finally:
        worker.terminate()
        worker.wait(timeout=60)


@contextmanager
def _monitor(app: object, enabled: bool) -> Iterator[list[int]]:
    """With ``enabled``, a task-event receiver on the broker (what ``celery events`` or Flower runs) for the
    block; yields the count of events it heard, in a one-element list."""
    heard = [0]
    if not enabled:
        yield heard
        return

    def count(_event: dict[str, object]) -> None:
        heard[0] += 1

    with app.connection_for_read() as conn:  # type: ignore[attr-defined]
        receiver = app.events.Receiver(conn, handlers={"*": count})  # type: ignore[attr-defined]
        thread = threading.Thread(target=receiver.capture, kwargs={"limit": None, "timeout": None}, daemon=True)
        thread.start()
        try:
            yield heard
        finally:
            receiver.should_stop = True
            thread.join(timeout=10)


def worker_throughput(broker_url: str, queues: list[str], count: int, argv: list[str],
                      conf: dict[str, object], events: bool = False) -> float:
    """``count`` no-ops pre-loaded on the last of ``queues``, then one worker on all of them: tasks/s. With
    ``events``: the worker runs with ``-E`` and a monitor hears its task events meanwhile."""
    import redis
    from celery import Celery

    observer = redis.Redis.from_url(OBSERVE_URL)
    key = f"bench:pg:{uuid.uuid4().hex}"
    producer = Celery("pg-bench-producer", broker=broker_url, set_as_current=False)
    with producer.producer_or_acquire() as pub:
        for _ in range(count):
            producer.send_task("bench.noop", args=[key], queue=queues[-1], producer=pub)
    try:
        with _monitor(producer, events) as heard, \
                _worker(broker_url, queues, [*argv, "-E"] if events else argv, conf, key) as (worker, log):
            deadline = time.monotonic() + 60 + count / 20
            while int(observer.get(f"{key}:n") or 0) < count:
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the worker did not run {count} tasks: see {log}")
                time.sleep(0.1)
            seconds = float(observer.get(f"{key}:last")) - float(observer.get(f"{key}:first"))  # type: ignore[arg-type]
            if events and heard[0] < count:
                raise RuntimeError(f"the monitor heard {heard[0]} events for {count} tasks")
            return count / seconds
    finally:
        observer.delete(f"{key}:n", f"{key}:first", f"{key}:last")
        producer.close()


def worker_pickup(broker_url: str, queue: str, argv: list[str], conf: dict[str, object], samples: int,
                  warmup: int = 10, pause: float = 0.02) -> tuple[float, float]:
    """One ping at a time to an idle worker (the last one ended): p50 of task start - send, and of task
    start - the publish's return (what is left once the producer's own send, a commit here, is done), ms."""
    import redis
    from celery import Celery

    observer = redis.Redis.from_url(OBSERVE_URL)
    key = f"bench:pgpick:{uuid.uuid4().hex}"
    producer = Celery("pg-bench-pickup", broker=broker_url, set_as_current=False)
    try:
        with _worker(broker_url, [queue], argv, conf, key) as (worker, log), \
                producer.producer_or_acquire() as pub:
            deadline = time.monotonic() + 60
            while b"ready." not in log.read_bytes():
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the worker did not start: see {log}")
                time.sleep(0.1)
            latencies, after_send = [], []
            for i in range(warmup + samples):
                time.sleep(pause)
                sent = time.time()
                # bench.ping records start - its argument: with 0.0, the start time itself.
                producer.send_task("bench.ping", args=[key, 0.0], queue=queue, producer=pub)
                returned = time.time()
                got = observer.blpop([key], timeout=30)
                if got is None:
                    raise RuntimeError(f"sample {i}: the ping did not run within 30 s: see {log}")
                if i >= warmup:
                    latencies.append((float(got[1]) - sent) * 1000)
                    after_send.append((float(got[1]) - returned) * 1000)
            return statistics.median(latencies), statistics.median(after_send)
    finally:
        observer.delete(key)
        producer.close()


def vacuum(db_url: str) -> None:
    """VACUUM the broker's table: each side starts from the same table, not the dead rows of the last.

    A side's 3,000 claims and acks leave ~6,000 dead tuples, and the runs are shorter than autovacuum's
    one-minute naptime: without this, the side that follows another walked the index entries of its
    deleted rows in every claim (the one-queue claim statement 275 → 383 µs p50, measured in a worker).
    """
    engine = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("VACUUM durable_broker_messages")
    finally:
        engine.dispose()


def dead_rows(db_url: str) -> int:
    """The broker table's dead row versions as PostgreSQL's statistics last heard (about a second behind)."""
    engine = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            return int(conn.exec_driver_sql(
                "SELECT coalesce(pg_stat_get_dead_tuples(to_regclass('durable_broker_messages')), 0)").scalar() or 0)
    finally:
        engine.dispose()


def statements_per_pass(db_url: str, queues: list[str]) -> int:
    """SQL statements one ``-P durable`` claim pass over ``queues`` (work on the last) sends, counted."""
    from celery_durable.broker.backend import PgRows

    with ensure_schema(db_url).begin() as conn:
        rows.insert(conn, [rows.Outgoing(queues[-1], {"properties": {}, "body": "x"})])
    backend = PgRows(db_url, lease_ttl=30)
    backend.claim_pass(queues, [1] * len(queues), 1)  # warm: the pool's connection is open
    with ensure_schema(db_url).begin() as conn:
        rows.insert(conn, [rows.Outgoing(queues[-1], {"properties": {}, "body": "y"})])
    seen: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        seen.append(statement)

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", count)
    # The claim goes to the driver on the consumer's kept connection: counted there too.
    backend.hot.listen(lambda statement, _params: seen.append(statement))
    try:
        asks = backend.claim_pass(queues, [1] * len(queues), 1)
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", count)
        backend.close()
    if sum(taken for _, _, taken, _ in asks) != 1:
        raise RuntimeError("the measured pass took no row")
    return len(seen)


def workers(pg_url: str, count: int, rounds: int, pickups: int, untouched: bool = False,
            worker_vacuum: int | None = None, events: bool = False) -> None:
    """Each round runs every side once, back to back (Redis, this broker, this broker on 200 queues)."""
    tag = uuid.uuid4().hex[:6]
    one = [f"pgb-{tag}-one"]
    many = [f"pgb-{tag}-{i:03d}" for i in range(200)]
    print(f"claim statements per pass, 200 queues with work on the last: "
          f"{statements_per_pass(pg_url.removeprefix('durable+'), many)}")
    for n in range(1, rounds + 1):
        print(f"-- round {n} (load average {os.getloadavg()[0]:.2f})")
        for name, argv, conf in WORKER_VARIANTS:
            if worker_vacuum is not None:
                conf = {**conf, "durable_broker_vacuum_dead_rows": worker_vacuum}
            sides = [(REDIS_URL, [f"pgb-{tag}-redis"]), (pg_url, one), (pg_url, many)]
            # Each round starts with another side: none always runs first (a cold machine) or right
            # after the same neighbour (the 200-queue side after the rows the one-queue side deleted).
            turn = (n - 1) % len(sides)
            rates = {}
            for url, queues in sides[turn:] + sides[:turn]:
                if url == pg_url and not untouched:
                    vacuum(pg_url.removeprefix("durable+"))
                rates[id(queues)] = worker_throughput(url, queues, count, argv, conf, events)
            redis_rate, pg_rate, pg_many = (rates[id(queues)] for _, queues in sides)
            print(f"{name}, {count} no-ops: Redis {redis_rate:,.0f}/s; PostgreSQL broker {pg_rate:,.0f}/s "
                  f"({pg_rate / redis_rate:.2f}x Redis); work on the last of 200 queues {pg_many:,.0f}/s "
                  f"({pg_many / pg_rate:.2f}x one queue); the table's dead rows now "
                  f"{dead_rows(pg_url.removeprefix('durable+')):,}")
        if pickups:
            name, argv, conf = WORKER_VARIANTS[0]
            redis_p50, redis_sent = worker_pickup(REDIS_URL, f"pgb-{tag}-redis-pick", argv, conf, pickups)
            pg_p50, pg_sent = worker_pickup(pg_url, f"pgb-{tag}-pick", argv, conf, pickups)
            print(f"{name}, idle pickup p50 ({pickups} pings): Redis {redis_p50:.2f} ms; PostgreSQL broker "
                  f"{pg_p50:.2f} ms ({pg_p50 - redis_p50:+.2f} ms); from the publish's return: Redis "
                  f"{redis_sent:.2f} ms, PostgreSQL broker {pg_sent:.2f} ms ({pg_sent - redis_sent:+.2f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--singles", type=int, default=2_000)
    parser.add_argument("--latency", type=int, default=200)
    parser.add_argument("--workers", type=int, default=0, metavar="N",
                        help="also real -P durable workers on N pre-loaded no-ops (Redis vs this broker)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of the worker figures (each side per round)")
    parser.add_argument("--pickups", type=int, default=0, metavar="N",
                        help="also a -P durable worker's idle pickup, N pings, on Redis and on this broker")
    parser.add_argument("--workers-only", action="store_true", help="skip the transport-alone figures")
    parser.add_argument("--untouched", action="store_true",
                        help="no VACUUM of the broker's table before each side: the workers' own vacuum alone")
    parser.add_argument("--worker-vacuum", type=int, default=None, metavar="DEAD_ROWS",
                        help="the workers' durable_broker_vacuum_dead_rows (0: none; default: the setting's)")
    parser.add_argument("--events", action="store_true",
                        help="workers with -E, and a task-event monitor on each side's broker meanwhile")
    args = parser.parse_args()

    register()
    schema = f"durable_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f"CREATE SCHEMA {schema}")
    db = f"{POSTGRES_URL}?options={quote(f'-csearch_path={schema}')}"
    url = f"durable+{db}"
    try:
        ensure_schema(db)
        if args.workers_only:
            workers(url, args.workers, args.rounds, args.pickups, args.untouched, args.worker_vacuum, args.events)
            return
        with Connection(url) as conn:
            published = batch_publish(conn, args.messages, args.batch)
            print(f"batch publish ({args.batch}/statement): {published:,.0f} messages/s")
            singles = single_publish(conn, args.singles)
            print(f"single publish: {singles:,.0f} messages/s")
            claimed = claim_and_ack(conn, args.messages)
            print(f"claim + ack (prefetch 100, acks deleted in batches): {claimed:,.0f} messages/s")
        p50, p99 = pickup_latency(url, args.latency)
        print(f"idle pickup, publish -> delivery ({args.latency} samples, LISTEN/NOTIFY): "
              f"p50 {p50:.2f} ms, p99 {p99:.2f} ms")
        if args.workers:
            workers(url, args.workers, args.rounds, args.pickups, args.untouched, args.worker_vacuum, args.events)
    finally:
        dispose_all()
        with admin.connect() as c:
            c.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
        admin.dispose()


if __name__ == "__main__":
    main()
