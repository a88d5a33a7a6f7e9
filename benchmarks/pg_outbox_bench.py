"""The outbox on the PostgreSQL broker (the message row in the caller's transaction) against today's relay on
Redis, side by side in one run.

    .venv/bin/python benchmarks/pg_outbox_bench.py [--burst 10000] [--latency 200]

- burst: ``burst`` enqueues in one transaction, then until every message is on the broker: on the
  PostgreSQL broker the commit is the publish; on Redis the relay (batch 500, one MULTI/EXEC each)
  drains the outbox after the commit. Also ``burst`` enqueues in a transaction each.
  rows/s = enqueues / (enqueue + commit [+ relay drain]).
- commit -> task start: a real ``celery worker -P durable -c 2`` per broker (on Redis its relay
  thread, on LISTEN/NOTIFY, publishes the outbox; on this broker it sleeps on LISTEN for the rows),
  ``latency`` single enqueues each committed and waited for: start time recorded by the task − commit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis
import sqlalchemy as sa
from celery import Celery

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from celery_durable import outbox
from celery_durable.broker import register
from celery_durable.outbox.relay import Relay
from celery_durable.store.engine import dispose_all, ensure_schema
from tests.services import OBSERVE_URL, REDIS_URL
from tests.stores import fresh_store


def make_app(broker: str, url: str) -> Celery:
    app = Celery(f"pg-outbox-bench-{uuid.uuid4().hex[:6]}", broker=broker, set_as_current=False)
    app.conf.durable_database_url = url
    return app


def burst(broker: str, url: str, count: int, *, one_transaction: bool) -> float:
    """rows/s of ``count`` enqueues until every message is on the broker."""
    app = make_app(broker, url)
    sig = app.signature("bench.noop", args=("burst",))
    queue = f"bench-pgo-{uuid.uuid4().hex[:8]}"
    user = sa.create_engine(url)
    relay = Relay(app, batch_size=500) if not broker.startswith("durable+") else None
    with user.begin() as conn:  # warm: schema check, producer pool, queue declaration
        outbox.enqueue(conn, sig, queue=queue)
    if relay is not None:
        relay.run_pass()
    start = time.perf_counter()
    if one_transaction:
        with user.begin() as conn:
            for _ in range(count):
                outbox.enqueue(conn, sig, queue=queue)
    else:
        for _ in range(count):
            with user.begin() as conn:
                outbox.enqueue(conn, sig, queue=queue)
    if relay is not None:
        while relay.run_pass().claimed:
            pass
    seconds = time.perf_counter() - start
    with app.connection_for_write() as conn:
        on_broker = conn.default_channel.queue_purge(queue)
    assert on_broker == count + 1, (on_broker, count)
    user.dispose()
    app.close()
    return count / seconds


def commit_to_start(broker: str, url: str, samples: int) -> tuple[float, float]:
    """p50, p99 ms from a single enqueue's commit to its task's start on a waiting ``-P durable`` worker."""
    observer = redis.Redis.from_url(OBSERVE_URL)
    key = f"bench:pgo:{uuid.uuid4().hex}"
    queue = f"bench-pgo-{uuid.uuid4().hex[:8]}"
    here = Path(__file__).resolve().parent
    conf = {"durable_database_url": url}
    env = dict(os.environ, BENCH_BROKER=broker, BENCH_QUEUES=queue, BENCH_CONF=json.dumps(conf),
               BENCH_OBSERVE=OBSERVE_URL,
               PYTHONPATH=os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")]))
    log = Path(tempfile.gettempdir()) / f"pgo-bench-{key.rsplit(':', 1)[1][:8]}.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "benchapp", "worker", "-P", "durable",
                                   "-c", "2", "-Q", queue, "--without-mingle", "--without-gossip", "-l", "warning"],
                                  cwd=here, env=env, stdout=out, stderr=subprocess.STDOUT)
    app = make_app(broker, url)
    user = sa.create_engine(url)
    try:
        deadline = time.monotonic() + 60
        while "ready." not in log.read_text(errors="replace"):
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start: see {log}")
            time.sleep(0.1)
        latencies = []
        for i in range(samples + 5):  # the first 5 warm the path and are not counted
            with user.begin() as conn:
                # bench.ping records start − sent; with sent 0 that is the start time itself.
                outbox.enqueue(conn, app.signature("bench.ping", args=(key, 0.0)), queue=queue)
            committed = time.time()
            popped = observer.blpop([key], timeout=30)
            if popped is None:
                raise RuntimeError(f"no start within 30 s: see {log}")
            if i >= 5:
                latencies.append(float(popped[1]) - committed)
        lat = sorted(latencies)
        return statistics.median(lat) * 1000, lat[max(0, int(len(lat) * 0.99) - 1)] * 1000
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        observer.delete(key)
        user.dispose()
        app.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--burst", type=int, default=10000)
    parser.add_argument("--latency", type=int, default=200)
    ns = parser.parse_args()
    register()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp, fresh_store("postgresql", Path(tmp)) as url:
        ensure_schema(url)
        pg = f"durable+{url}"
        for one in (True, False):
            shape = "one transaction" if one else "a transaction each"
            redis_rate = burst(REDIS_URL, url, ns.burst, one_transaction=one)
            pg_rate = burst(pg, url, ns.burst, one_transaction=one)
            print(f"burst of {ns.burst:,} enqueues, {shape}: relay to Redis {redis_rate:,.0f} rows/s; "
                  f"PostgreSQL broker {pg_rate:,.0f} rows/s ({pg_rate / redis_rate:.2f}x)")
        redis_p50, redis_p99 = commit_to_start(REDIS_URL, url, ns.latency)
        pg_p50, pg_p99 = commit_to_start(pg, url, ns.latency)
        print(f"commit -> task start, -P durable -c 2 waiting, {ns.latency} samples: relay to Redis "
              f"p50 {redis_p50:.2f} ms, p99 {redis_p99:.2f} ms; PostgreSQL broker p50 {pg_p50:.2f} ms, "
              f"p99 {pg_p99:.2f} ms")
        dispose_all()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
