"""Outbox relay throughput, enqueue+relay cost against a direct apply_async, and commit-to-publish latency.

    /work/venv/bin/python benchmarks/outbox_bench.py [--rows 20000] [--tasks 2000] [--latency 200] [--profile]

PostgreSQL (a fresh schema) -> Redis and -> RabbitMQ, in one run:
- relay throughput, per broker: ``rows`` committed rows, then relay passes
  (batch 500) until the outbox is empty: rows/s of claim + publish + mark (Redis:
  one MULTI/EXEC per batch; RabbitMQ: publisher confirms, one wait per batch);
  ``--profile`` prints where a Redis drain spends its time;
- per-task cost (Redis): ``tasks`` x (own transaction, outbox.enqueue, commit)
  plus the relay's share, against ``tasks`` x apply_async on the same broker;
- commit-to-publish latency: ``latency`` single-row commits, each waited for,
  with the relay in a thread on LISTEN/NOTIFY (poll interval 5 s, so only a
  notification explains a fast publish): p50 / p99 of published_at - commit.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import threading
import time
import uuid
from datetime import timezone
from pathlib import Path

import redis
import sqlalchemy as sa
from celery import Celery

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from celery_durable import outbox
from celery_durable.outbox.relay import Relay
from celery_durable.store import outbox as store
from celery_durable.store.engine import autocommit, ensure_schema
from tests.services import AMQP_URL, REDIS_URL
from tests.stores import fresh_store


def make_app(url: str, broker: str = REDIS_URL) -> Celery:
    app = Celery("outbox-bench", broker=broker)
    app.conf.durable_database_url = url

    @app.task(name="bench.noop", shared=False)
    def noop(i: int) -> int:
        return i

    return app


def backlog(url: str) -> int:
    with autocommit(ensure_schema(url)).connect() as conn:
        return store.backlog(conn)[0]


def relay_throughput(broker: str, rows: int, *, profile: bool = False) -> tuple[float, float, str]:
    """(rows/s, seconds, profile text) of draining ``rows`` committed rows to ``broker`` in batches of 500.

    Each run gets a schema of its own: rows published by an earlier run (and
    their dead index entries) would slow the claim query of the next one.
    """
    with tempfile.TemporaryDirectory() as tmp, fresh_store("postgresql", Path(tmp)) as url:
        ensure_schema(url)
        return _drain(url, broker, rows, profile)


def _drain(url: str, broker: str, rows: int, profile: bool) -> tuple[float, float, str]:
    app = make_app(url, broker)
    noop = app.tasks["bench.noop"]
    user = sa.create_engine(url)
    queue = f"bench-outbox-{uuid.uuid4().hex[:8]}"
    with user.begin() as conn:
        for i in range(rows):
            outbox.enqueue(conn, noop.s(i), queue=queue)
    relay = Relay(app, batch_size=500)
    first = relay.run_pass()  # warm the producer pool and the queue declaration
    assert first.batched == 500, first
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    while relay.run_pass().claimed:
        pass
    if profiler:
        profiler.disable()
    seconds = time.perf_counter() - start
    assert backlog(url) == 0
    text = ""
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(30)
        text = out.getvalue()
    with app.connection_for_write() as conn:
        conn.default_channel.queue_purge(queue)
        if broker.startswith("amqp"):
            conn.default_channel.queue_delete(queue)
    user.dispose()
    app.close()
    return (rows - 500) / seconds, seconds, text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--latency", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the Redis relay drain")
    ns = parser.parse_args()
    client = redis.Redis.from_url(REDIS_URL)
    # 1. relay throughput, each broker
    relay_rate, relay_s, _ = relay_throughput(REDIS_URL, ns.rows)
    amqp_rate, amqp_s, _ = relay_throughput(AMQP_URL, ns.rows)
    profile_text = relay_throughput(REDIS_URL, ns.rows, profile=True)[2] if ns.profile else ""
    with tempfile.TemporaryDirectory() as tmp, fresh_store("postgresql", Path(tmp)) as url:
        ensure_schema(url)
        app = make_app(url)
        noop = app.tasks["bench.noop"]
        user = sa.create_engine(url)
        queue = f"bench-outbox-{uuid.uuid4().hex[:8]}"
        relay = Relay(app, batch_size=500)

        # 2. per-task cost: enqueue in its own transaction + relay vs apply_async
        start = time.perf_counter()
        for i in range(ns.tasks):
            noop.apply_async((i,), queue=queue)
        direct_s = time.perf_counter() - start
        client.delete(queue)
        start = time.perf_counter()
        for i in range(ns.tasks):
            with user.begin() as conn:
                outbox.enqueue(conn, noop.s(i), queue=queue)
        enqueue_s = time.perf_counter() - start
        start = time.perf_counter()
        while relay.run_pass().claimed:
            pass
        drain_s = time.perf_counter() - start
        assert client.llen(queue) == ns.tasks
        client.delete(queue)

        # 3. commit-to-publish latency on LISTEN/NOTIFY
        listener = Relay(app, poll_interval=5.0)
        thread = threading.Thread(target=listener.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not (listener._waker is not None and listener._waker.listening):
            if time.monotonic() > deadline:
                raise SystemExit("relay did not LISTEN")
            time.sleep(0.01)
        latencies = []
        with autocommit(ensure_schema(url)).connect() as reader:
            for i in range(ns.latency):
                with user.begin() as conn:
                    task_id = outbox.enqueue(conn, noop.s(i), queue=queue).id
                committed = time.time()
                while True:
                    row = store.get(reader, task_id)
                    if row and row["published_at"] is not None:
                        break
                    time.sleep(0.001)
                latencies.append(row["published_at"].astimezone(timezone.utc).timestamp() - committed)
        listener.stop()
        thread.join(10)
        client.delete(queue)
        user.dispose()

    lat = sorted(latencies)
    p50 = statistics.median(lat) * 1000
    p99 = lat[max(0, int(len(lat) * 0.99) - 1)] * 1000
    per_direct = direct_s / ns.tasks * 1e6
    per_outbox = (enqueue_s + drain_s) / ns.tasks * 1e6
    print(f"relay throughput (PostgreSQL -> Redis, batch 500, one MULTI/EXEC each): {relay_rate:,.0f} rows/s "
          f"({ns.rows - 500} rows in {relay_s:.2f} s)")
    print(f"relay throughput (PostgreSQL -> RabbitMQ, batch 500, publisher confirms): {amqp_rate:,.0f} rows/s "
          f"({ns.rows - 500} rows in {amqp_s:.2f} s)")
    print(f"direct apply_async: {per_direct:,.0f} us/task")
    print(f"outbox.enqueue + commit (own txn): {enqueue_s / ns.tasks * 1e6:,.0f} us/task; "
          f"relay share: {drain_s / ns.tasks * 1e6:,.0f} us/task; total {per_outbox:,.0f} us/task "
          f"({per_outbox / per_direct:.2f}x direct)")
    print(f"commit-to-publish (LISTEN/NOTIFY, {ns.latency} commits): p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    if profile_text:
        print(profile_text)


if __name__ == "__main__":
    main()
