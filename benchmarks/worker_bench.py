"""Side-by-side benchmark of ``-P durable`` against stock Celery workers, same broker, same run.

    /work/venv/bin/python benchmarks/worker_bench.py [--broker redis|rabbitmq|all] [--quick]
                                                     [--rounds N] [--scenarios a,b] [--write benchmarks/RESULTS.md]

Scenarios (each on its own unique queues, cleaned up afterwards):

1. throughput  N no-op tasks pre-loaded, then the worker starts; tasks/s from the first
               task's start to the last task's end (min/max kept in Redis by one Lua call
               per task). Also the worker's CPU per task (its process and pool children,
               from /proc, between "ready" and the last task).
2. pickup      one task at a time to an idle worker; latency = task start − send time.
3. head-of-line  two workers -c1 on one queue; one 4 s task then 12 × 0.1 s tasks; the
               worst short-task start latency (ideal ≈ 1.2 s).
4. isolation   one worker -c4; 40 × 1 s tasks on `bulk`, then 40 × 10 ms on `interactive`;
               p50/p99 start latency of the interactive tasks.
5. queues      2,000 no-op tasks on the LAST of 1, 10, 50, 200 queues (others empty), and spread
               over 50; stock (default, and buffering nothing) vs durable prefork -c2; the durable
               worker's claim round trips per pass (inspect stats: claim_round_trips / claim_passes).
6. late        while a worker drains 20,000 no-ops on the last of 50 queues, one task at a time
               lands on another (empty) queue: its start − send latency, stock vs durable, and
               whether durable's p50 is within stock's + 2 ms (issue 28's bound).

Workers are real ``python -m celery -A benchapp worker`` subprocesses run at ``-l warning``
(no per-task log lines); readiness is read from their log with a deadline, and they are
stopped with SIGTERM. Times are wall clock on one machine (sender and worker share it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import redis
from celery import Celery

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

BROKER_URLS = {
    # A database of its own: kombu's unacked hash is per database, so nothing
    # else running on this Redis (tests on db 0) shares it with the benchmark.
    "redis": os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/14"),
    "rabbitmq": os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//"),
}
OBSERVE_URL = os.environ.get("BENCH_OBSERVE_URL", "redis://127.0.0.1:6379/15")
REDIS_PRIORITY_SEP = "\x06\x16"
CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchFailed(RuntimeError):
    """One variant of one scenario could not be measured (the run goes on)."""


def wait_for(condition: Callable[[], Any], *, timeout: float, what: str, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchFailed(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


# -- what is compared --------------------------------------------------------------------
@dataclass(frozen=True, eq=False)  # compared by identity: a variant is one entry of a plan
class Variant:
    label: str
    pool: str
    concurrency: int
    conf: dict[str, Any] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    redis_only: bool = False
    #: The app module the worker runs (-A).
    app: str = "benchapp"

    @property
    def durable(self) -> bool:
        return self.pool == "durable"

    def command_line(self) -> str:
        conf = f" conf={json.dumps(self.conf)}" if self.conf else ""
        return f"-P {self.pool} -c{self.concurrency} {' '.join(self.args)}".strip() + conf


# -- workers -----------------------------------------------------------------------------
def proc_cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    # After the comm field: state is [0], utime [11], stime [12].
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


class Worker:
    """A ``celery -A benchapp worker`` subprocess."""

    def __init__(self, broker_url: str, queues: Sequence[str], variant: Variant, log_dir: Path) -> None:
        self.variant = variant
        tag = uuid.uuid4().hex[:8]
        self.name = f"bench-{tag}@%h"
        self.node = f"bench-{tag}"
        self.log_path = log_dir / f"{variant.pool}-{tag}.log"
        env = dict(os.environ)
        env.update(
            BENCH_BROKER=broker_url,
            BENCH_QUEUES=",".join(queues),
            BENCH_CONF=json.dumps(variant.conf),
            BENCH_OBSERVE=OBSERVE_URL,
            PYTHONPATH=os.pathsep.join([str(HERE), str(REPO),
                                        env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        )
        self.argv = [sys.executable, "-m", "celery", "-A", variant.app, "worker",
                     "-P", variant.pool, "-c", str(variant.concurrency), "-Q", ",".join(queues),
                     "-n", self.name, "--without-mingle", "--without-gossip", "-l", "warning",
                     *variant.args]
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.argv, cwd=HERE, env=env, stdout=self._log,
                                        stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def hostname(self) -> str:
        return self.name.replace("%h", socket.gethostname())

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            lines = [line for line in self.log().splitlines() if line.strip()]
            last = lines[-1].strip() if lines else "no output"
            raise BenchFailed(f"worker exited with {self.process.returncode} ({last[:160]}); "
                              f"log {self.log_path}:\n" + "\n".join(lines[-30:]))

    def wait_ready(self, timeout: float = 60.0) -> Worker:
        def ready() -> bool:
            self.check_alive()
            return " ready." in self.log()
        wait_for(ready, timeout=timeout, what=f"worker {self.node} to be ready")
        return self

    def cpu_seconds(self) -> float:
        """CPU used so far by the worker process and its pool children."""
        pid = self.process.pid
        return proc_cpu_seconds(pid) + sum(proc_cpu_seconds(c) for c in children_of(pid))

    def signal_term(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout: float = 60.0) -> int | None:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"  ! worker {self.node} ignored SIGTERM for {timeout:.0f}s; killing it", file=sys.stderr)
            for child in children_of(self.process.pid):
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.process.kill()
            return self.process.wait(timeout=30)
        finally:
            self._log.close()


def stop_all(workers: Iterable[Worker]) -> None:
    workers = list(workers)
    for w in workers:
        w.signal_term()
    for w in workers:
        w.wait_exit()


# -- the broker side -------------------------------------------------------------------
class Broker:
    def __init__(self, kind: str, log_dir: Path) -> None:
        self.kind = kind
        self.url = BROKER_URLS[kind]
        self.log_dir = log_dir
        self.app = Celery("bench-producer", broker=self.url)
        self.app.conf.broker_connection_retry_on_startup = True
        self.observer = redis.Redis.from_url(OBSERVE_URL)

    def check(self) -> str | None:
        try:
            self.observer.ping()
            with self.app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=1)
        except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
            return repr(exc)
        return None

    def queues(self, *names: str) -> list[str]:
        suffix = uuid.uuid4().hex[:8]
        return [f"bench-{name}-{suffix}" for name in names]

    def worker(self, queues: Sequence[str], variant: Variant) -> Worker:
        return Worker(self.url, queues, variant, self.log_dir)

    def declare(self, queues: Iterable[str]) -> None:
        with self.app.connection_for_write() as conn:
            for name in queues:
                self.app.amqp.queues[name](conn.default_channel).declare()

    def preload(self, queue: str, task: str, args_for: Callable[[int], list[Any]], count: int) -> float:
        """Publish ``count`` tasks; returns the seconds it took."""
        t0 = time.perf_counter()
        with self.app.producer_or_acquire() as producer:
            for i in range(count):
                self.app.send_task(task, args=args_for(i), queue=queue, producer=producer)
        return time.perf_counter() - t0

    def depth(self, queue: str) -> int:
        if self.kind == "redis":
            client = redis.Redis.from_url(self.url)
            return sum(int(client.llen(n)) for n in
                       [queue] + [f"{queue}{REDIS_PRIORITY_SEP}{p}" for p in (3, 6, 9)])
        with self.app.connection_for_write() as conn:
            _, count, _ = conn.default_channel.queue_declare(queue=queue, passive=True)
            return int(count)

    def cleanup(self, queues: Iterable[str], workers: Iterable[Worker] = (), keys: Iterable[str] = ()) -> None:
        queues, workers, keys = list(queues), list(workers), list(keys)
        try:
            if keys:
                self.observer.delete(*keys)
            if self.kind == "redis":
                client = redis.Redis.from_url(self.url)
                names = []
                for q in queues:
                    names += [q, *(f"{q}{REDIS_PRIORITY_SEP}{p}" for p in (3, 6, 9)),
                              f"_kombu.binding.{q}", f"_kombu.binding_permanent.{q}"]
                client.delete(*names)
                # Each worker's remote-control queue and its binding.
                for w in workers:
                    pidbox = f"{w.node}@{os.uname().nodename}.celery.pidbox"
                    client.delete(pidbox, *(f"{pidbox}{REDIS_PRIORITY_SEP}{p}" for p in (3, 6, 9)))
                    for member in client.smembers("_kombu.binding.celery.pidbox"):
                        if w.node.encode() in member:
                            client.srem("_kombu.binding.celery.pidbox", member)
            else:
                with self.app.connection_for_write() as conn:
                    for q in queues:
                        conn.default_channel.queue_delete(q)
                        conn.default_channel.exchange_delete(q)
        except Exception as exc:  # noqa: BLE001 - best effort; every name is unique anyway
            print(f"  ! cleanup failed: {exc!r}", file=sys.stderr)


# -- scenarios ------------------------------------------------------------------------------
@dataclass
class Row:
    scenario: str
    broker: str
    variant: Variant
    figures: dict[str, Any]
    error: str | None = None


def run_throughput(broker: Broker, variant: Variant, count: int, task: str = "bench.noop",
                   extra_args: Callable[[int], list[Any]] = lambda i: []) -> dict[str, Any]:
    """``count`` tasks pre-loaded, then one worker; ``task`` takes the tally key, then ``extra_args(i)``."""
    (queue,) = broker.queues("tp")
    key = f"bench:tp:{uuid.uuid4().hex}"
    workers: list[Worker] = []
    try:
        broker.declare([queue])
        broker.preload(queue, task, lambda i: [key, *extra_args(i)], count)
        w = broker.worker([queue], variant)
        workers.append(w)
        w.wait_ready()
        cpu0 = w.cpu_seconds()
        seconds = drain_seconds(broker, w, key, count, f"{count} {task} tasks")
        cpu = w.cpu_seconds() - cpu0
        return {"rate": count / seconds, "seconds": seconds, "cpu_ms": 1000 * cpu / count}
    finally:
        stop_all(workers)
        broker.cleanup([queue], workers, [f"{key}:n", f"{key}:first", f"{key}:last"])


def drain_seconds(broker: Broker, w: Worker, key: str, count: int, what: str) -> float:
    """Wait for ``count`` tallied tasks under ``key``; the seconds from the first start to the last end."""
    def done() -> bool:
        w.check_alive()
        return int(broker.observer.get(f"{key}:n") or 0) >= count
    wait_for(done, timeout=60 + count / 20, what=what, every=0.1)
    return float(broker.observer.get(f"{key}:last")) - float(broker.observer.get(f"{key}:first"))


def run_pickup(broker: Broker, variant: Variant, samples: int, warmup: int = 10,
               pause: float = 0.02) -> dict[str, Any]:
    (queue,) = broker.queues("pickup")
    key = f"bench:pickup:{uuid.uuid4().hex}"
    workers: list[Worker] = []
    try:
        w = broker.worker([queue], variant)
        workers.append(w)
        w.wait_ready()
        latencies = []
        with broker.app.producer_or_acquire() as producer:
            for i in range(warmup + samples):
                # The worker is idle again before each send: the previous task has
                # finished and its slot has been freed (the pause covers the ack).
                time.sleep(pause)
                sent = time.time()
                broker.app.send_task("bench.ping", args=[key, sent], queue=queue, producer=producer)
                got = broker.observer.blpop([key], timeout=30)
                if got is None:
                    w.check_alive()
                    raise BenchFailed(f"sample {i}: the task did not run within 30 s")
                if i >= warmup:
                    latencies.append(float(got[1]) * 1000)
        return {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99),
                "max": max(latencies), "n": len(latencies)}
    finally:
        stop_all(workers)
        broker.cleanup([queue], workers, [key])


def run_many_queues(broker: Broker, variant: Variant, count: int, queue_count: int,
                    spread: bool) -> dict[str, Any]:
    """``count`` no-op tasks on the LAST of ``queue_count`` queues (or spread over all), the others empty."""
    queues = broker.queues(*[f"mq{i}" for i in range(queue_count)])
    key = f"bench:mq:{uuid.uuid4().hex}"
    workers: list[Worker] = []
    try:
        broker.declare(queues)
        targets = queues if spread else queues[-1:]
        for n, target in enumerate(targets):
            # count split evenly, the first queues taking the remainder
            broker.preload(target, "bench.noop", lambda i: [key], count // len(targets) + int(n < count % len(targets)))
        w = broker.worker(queues, variant)
        workers.append(w)
        w.wait_ready()
        seconds = drain_seconds(broker, w, key, count, f"{count} tasks over {queue_count} queues")
        figures: dict[str, Any] = {"rate": count / seconds}
        if variant.durable:
            stats = broker.app.control.inspect(destination=[w.hostname], timeout=3).stats() or {}
            durable = next(iter(stats.values()), {}).get("durable", {})
            passes = durable.get("claim_passes") or 0
            if passes:
                figures["round_trips_per_pass"] = durable.get("claim_round_trips", 0) / passes
        return figures
    finally:
        stop_all(workers)
        broker.cleanup(queues, workers, [f"{key}:n", f"{key}:first", f"{key}:last"])


def run_late_pickup(broker: Broker, variant: Variant, count: int, queue_count: int,
                    samples: int) -> dict[str, Any]:
    """A worker drains ``count`` no-ops on the last of ``queue_count`` queues; meanwhile one
    task at a time lands on another queue, empty until then: its start − send latency."""
    queues = broker.queues(*[f"late{i}" for i in range(queue_count)])
    key = f"bench:late:{uuid.uuid4().hex}"
    workers: list[Worker] = []
    try:
        broker.declare(queues)
        broker.preload(queues[-1], "bench.noop", lambda i: [key], count)
        w = broker.worker(queues, variant)
        workers.append(w)
        w.wait_ready()
        wait_for(lambda: int(broker.observer.get(f"{key}:n") or 0) > 0, timeout=30, what="the drain to start")
        latencies = []
        with broker.app.producer_or_acquire() as producer:
            for i in range(samples):
                time.sleep(0.03)
                sent = time.time()
                broker.app.send_task("bench.ping", args=[f"{key}:late", sent], queue=queues[i % (queue_count - 1)],
                                     producer=producer)
                got = broker.observer.blpop([f"{key}:late"], timeout=30)
                if got is None:
                    w.check_alive()
                    raise BenchFailed(f"late sample {i}: the task did not run within 30 s")
                latencies.append(float(got[1]) * 1000)
        drained = int(broker.observer.get(f"{key}:n") or 0)
        if drained >= count:
            raise BenchFailed(f"the drain ended before the last late sample ({count} tasks): raise --count")
        return {"p50": percentile(latencies, 50), "max": max(latencies), "n": len(latencies)}
    finally:
        stop_all(workers)
        broker.cleanup(queues, workers, [f"{key}:n", f"{key}:first", f"{key}:last", f"{key}:late"])


def _collect(broker: Broker, key: str, count: int, workers: Sequence[Worker], timeout: float) -> list[dict[str, Any]]:
    def enough() -> bool:
        for w in workers:
            w.check_alive()
        return broker.observer.llen(key) >= count
    wait_for(enough, timeout=timeout, what=f"{count} tasks to start")
    return [json.loads(raw) for raw in broker.observer.lrange(key, 0, -1)]


def run_head_of_line(broker: Broker, variant: Variant, shorts: int = 12, long_s: float = 4.0,
                     short_s: float = 0.1) -> dict[str, Any]:
    (queue,) = broker.queues("hol")
    key = f"bench:hol:{uuid.uuid4().hex}"
    workers: list[Worker] = []
    try:
        workers = [broker.worker([queue], variant), broker.worker([queue], variant)]
        for w in workers:
            w.wait_ready()
        with broker.app.producer_or_acquire() as producer:
            def send(label: str, seconds: float) -> None:
                broker.app.send_task("bench.work", args=[key, label, time.time(), seconds],
                                     queue=queue, producer=producer)
            send("long", long_s)
            for i in range(shorts):
                send(f"short{i}", short_s)
        events = _collect(broker, key, shorts + 1, workers, timeout=60)
        short = [e["latency"] for e in events if e["label"].startswith("short")]
        return {"worst": max(short), "ideal": shorts * short_s, "p50": percentile(short, 50)}
    finally:
        stop_all(workers)
        broker.cleanup([queue], workers, [key])


def run_isolation(broker: Broker, variant: Variant, bulk: int, interactive: int,
                  bulk_s: float = 1.0, interactive_s: float = 0.01) -> dict[str, Any]:
    bulk_q, inter_q = broker.queues("bulk", "interactive")
    key = f"bench:iso:{uuid.uuid4().hex}"
    workers: list[Worker] = []
    if variant.durable:
        # The queue's real (unique) name is only known now.
        variant = replace(variant, conf={**variant.conf, "durable_queue_concurrency": {bulk_q: 2}})
    try:
        w = broker.worker([bulk_q, inter_q], variant)
        workers.append(w)
        w.wait_ready()
        with broker.app.producer_or_acquire() as producer:
            for i in range(bulk):
                broker.app.send_task("bench.work", args=[key, f"bulk{i}", time.time(), bulk_s],
                                     queue=bulk_q, producer=producer)
            for i in range(interactive):
                broker.app.send_task("bench.work", args=[key, f"inter{i}", time.time(), interactive_s],
                                     queue=inter_q, producer=producer)

        def all_interactive() -> bool:
            w.check_alive()
            return sum(1 for raw in broker.observer.lrange(key, 0, -1)
                       if b'"inter' in raw) >= interactive
        wait_for(all_interactive, timeout=30 + bulk * bulk_s, what=f"{interactive} interactive tasks", every=0.05)
        events = [json.loads(raw) for raw in broker.observer.lrange(key, 0, -1)]
        lat = [e["latency"] * 1000 for e in events if e["label"].startswith("inter")]
        bulk_started = sum(1 for e in events if e["label"].startswith("bulk"))
        return {"min": min(lat), "p50": percentile(lat, 50), "p99": percentile(lat, 99), "max": max(lat),
                "bulk_started": bulk_started}
    finally:
        stop_all(workers)
        broker.cleanup([bulk_q, inter_q], workers, [key])


# -- the plan ---------------------------------------------------------------------------------
def throughput_variants() -> list[Variant]:
    return [
        Variant("stock threads -c8", "threads", 8),
        Variant("stock threads -c8 --disable-prefetch", "threads", 8, args=("--disable-prefetch",),
                redis_only=True),
        # Stock holding no message it cannot run at once (on RabbitMQ as on
        # Redis): as -P durable does, it waits a round trip per freed slot.
        Variant("stock threads -c8 acks_late + multiplier 1", "threads", 8, NOTHING_BUFFERED),
        Variant("durable threads -c8", "durable", 8,
                {"durable_execution": "threads", "durable_max_in_flight": 8}),
        # Like for like with stock buffering nothing, whose acks are late too; on RabbitMQ a worker with
        # one open queue then consumes it push-style, credit = room (docs/claiming.md).
        Variant("durable threads -c8 acks_late", "durable", 8,
                {"durable_execution": "threads", "durable_max_in_flight": 8, "task_acks_late": True}),
        Variant("stock prefork -c2", "prefork", 2),
        Variant("stock prefork -c2 --disable-prefetch", "prefork", 2, args=("--disable-prefetch",),
                redis_only=True),
        Variant("stock prefork -c2 acks_late + multiplier 1", "prefork", 2, NOTHING_BUFFERED),
        Variant("durable prefork -c2", "durable", 2, {"durable_max_in_flight": 2}),
        Variant("durable prefork -c2 acks_late", "durable", 2, {"durable_max_in_flight": 2, "task_acks_late": True}),
    ]


#: Stock settings under which a worker holds no more messages than it runs.
NOTHING_BUFFERED = {"task_acks_late": True, "worker_prefetch_multiplier": 1}


def pickup_variants() -> list[Variant]:
    return [
        Variant("stock threads -c8", "threads", 8),
        Variant("durable threads -c8", "durable", 8,
                {"durable_execution": "threads", "durable_max_in_flight": 8}),
        Variant("stock prefork -c2", "prefork", 2),
        Variant("durable prefork -c2", "durable", 2, {"durable_max_in_flight": 2}),
    ]


def many_queue_variants() -> list[Variant]:
    return [
        Variant("stock prefork -c2", "prefork", 2),
        Variant("durable prefork -c2", "durable", 2, {"durable_max_in_flight": 2}),
    ]


def queues_variants() -> list[Variant]:
    """The many-queues scenario's workers: beside stock's default, stock buffering nothing (issue 28's
    single-queue reference), so the cost of many queues reads apart from the cost of not prefetching."""
    stock, durable = many_queue_variants()
    return [stock, Variant("stock prefork -c2 acks_late + multiplier 1", "prefork", 2, NOTHING_BUFFERED), durable]


#: (queues served, work spread over all of them?) for the many-queues scenario.
MANY_QUEUE_CASES = [(1, False), (10, False), (50, False), (200, False), (50, True)]


def hol_variants() -> list[Variant]:
    return [
        Variant("stock default prefetch", "prefork", 1),
        Variant("stock acks_late + multiplier 1", "prefork", 1, NOTHING_BUFFERED),
        Variant("stock --disable-prefetch", "prefork", 1, args=("--disable-prefetch",), redis_only=True),
        Variant("durable (no tuning)", "durable", 1),
    ]


def isolation_variants() -> list[Variant]:
    return [
        Variant("stock default", "prefork", 4),
        Variant("stock acks_late + multiplier 1", "prefork", 4, NOTHING_BUFFERED),
        Variant("stock --disable-prefetch", "prefork", 4, args=("--disable-prefetch",), redis_only=True),
        Variant("durable bulk=2 slots, max_in_flight 4", "durable", 4, {"durable_max_in_flight": 4}),
    ]


def base_pool(variant: Variant) -> str:
    """The stock pool a variant's runs execute in (a durable worker's ``durable_execution``)."""
    return variant.conf.get("durable_execution", "prefork") if variant.durable else variant.pool


def stock_baseline(variant: Variant, variants: Sequence[Variant]) -> Variant | None:
    """The stock variant a durable one is compared with: same execution, no tuning."""
    if not variant.durable:
        return None
    execution = base_pool(variant)
    for v in variants:
        if not v.durable and v.pool == execution and not v.args and not v.conf:
            return v
    for v in variants:
        if not v.durable and not v.args and not v.conf:
            return v
    return None


# -- report ---------------------------------------------------------------------------------
def fmt(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def render(rows: list[Row], *, count: int, rounds: int, samples: int, iso: tuple[int, int]) -> str:
    out: list[str] = []

    def by(scenario: str) -> list[Row]:
        return [r for r in rows if r.scenario == scenario]

    def table(header: list[str], lines: list[list[str]]) -> None:
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join("---" for _ in header) + "|")
        out.extend("| " + " | ".join(line) + " |" for line in lines)
        out.append("")

    def baseline_row(row: Row, pool_rows: list[Row]) -> Row | None:
        base = stock_baseline(row.variant, [r.variant for r in pool_rows])
        for r in pool_rows:
            if r.variant == base and r.broker == row.broker and r.error is None:
                return r
        return None

    tp = by("throughput")
    if tp:
        out.append(f"### 1. No-op throughput ({count:,} tasks pre-loaded; tasks/s first start → last end; "
                   f"median of {rounds} interleaved round(s))")
        out.append("")
        lines = []
        for r in tp:
            if r.error:
                lines.append([r.broker, r.variant.label, "FAILED", "", "", r.error[:80]])
                continue
            rates = r.figures["rates"]
            base = baseline_row(r, [x for x in tp if x.broker == r.broker])
            ratio = unbuffered_ratio = ""
            if base is not None:
                ratio = f"**{statistics.median(rates) / statistics.median(base.figures['rates']):.2f}×**"
            unbuffered = next((x for x in tp if r.variant.durable and x.broker == r.broker and x.error is None
                               and x.variant.pool == base_pool(r.variant) and x.variant.conf == NOTHING_BUFFERED),
                              None)
            if unbuffered is not None:
                unbuffered_ratio = f"{statistics.median(rates) / statistics.median(unbuffered.figures['rates']):.2f}×"
            lines.append([r.broker, r.variant.label, fmt(statistics.median(rates)),
                          " / ".join(fmt(x) for x in rates), fmt(statistics.median(r.figures["cpu_ms"]), 3),
                          ratio, unbuffered_ratio])
        table(["broker", "worker", "tasks/s", "rounds", "worker CPU ms/task", "durable / stock",
               "durable / stock acks_late + multiplier 1"], lines)

    pk = by("pickup")
    if pk:
        out.append(f"### 2. Idle pickup latency (task start − send; {samples} samples, one at a time; ms)")
        out.append("")
        lines = []
        for r in pk:
            if r.error:
                lines.append([r.broker, r.variant.label, "FAILED", "", "", r.error[:80]])
                continue
            f = r.figures
            base = baseline_row(r, [x for x in pk if x.broker == r.broker])
            delta = ""
            if base is not None:
                d = f["p50"] - base.figures["p50"]
                delta = f"**{d:+.2f} ms** ({f['p50'] / base.figures['p50']:.2f}×)"
            lines.append([r.broker, r.variant.label, fmt(f["p50"], 2), fmt(f["p99"], 2), fmt(f["max"], 1), delta])
        table(["broker", "worker", "p50", "p99", "max", "durable p50 − stock p50"], lines)

    hol = by("hol")
    if hol:
        out.append("### 3. Head-of-line (2 workers -c1 prefork, one queue; one 4 s task then 12 × 0.1 s; "
                   "worst short-task start − send; ideal ≈ 1.2 s)")
        out.append("")
        lines = []
        for r in hol:
            if r.error:
                lines.append([r.broker, r.variant.label, "FAILED", "", r.error[:80]])
                continue
            f = r.figures
            lines.append([r.broker, r.variant.label, f"**{f['worst']:.2f} s**", f"{f['p50']:.2f} s",
                          f"{f['worst'] / f['ideal']:.2f}×"])
        table(["broker", "workers", "worst short task", "p50 short task", "worst / ideal"], lines)

    mq = by("queues")
    if mq:
        out.append("### 5. Many queues (2,000 no-op tasks on the LAST of N queues, the others empty, or spread "
                   "over all; prefork -c2; tasks/s, median of the rounds; claim round trips per pass)")
        out.append("")
        lines = []
        cases = sorted({(r.broker, r.figures.get("queues", 0), r.figures.get("spread", False)) for r in mq
                        if not r.error}, key=lambda c: (c[0], c[2], c[1]))
        for kind, n, spread in cases:
            case = [r for r in mq if not r.error and r.broker == kind and r.figures["queues"] == n
                    and r.figures["spread"] == spread]
            stock = [r.figures["rate"] for r in case if not r.variant.durable and not r.variant.conf]
            unbuffered = [r.figures["rate"] for r in case if r.variant.conf == NOTHING_BUFFERED]
            durable = [r.figures["rate"] for r in case if r.variant.durable]
            trips = [r.figures["round_trips_per_pass"] for r in case if "round_trips_per_pass" in r.figures]
            if not stock or not durable:
                continue
            ratio = statistics.median(durable) / statistics.median(stock)
            unbuffered_ratio = (f"{statistics.median(durable) / statistics.median(unbuffered):.2f}×"
                                if unbuffered else "")
            lines.append([kind, str(n), "all" if spread else "last", fmt(statistics.median(stock)),
                          fmt(statistics.median(durable)), f"**{ratio:.2f}×**", unbuffered_ratio,
                          f"{statistics.median(trips):.2f}" if trips else "?"])
        table(["broker", "queues", "work on", "stock tasks/s", "durable tasks/s", "durable / stock",
               "durable / stock acks_late + multiplier 1", "round trips / pass"], lines)
        failures = [r for r in mq if r.error]
        for r in failures:
            out.append(f"- FAILED {r.broker} {r.variant.label}: {r.error[:100]}")
        out.append("")

    late = by("late")
    if late:
        out.append("### 6. A late task on a queue found empty (a worker drains no-ops on the last of 50 queues; "
                   "one task at a time lands on another; its start − send, ms; all rounds pooled)")
        out.append("")
        lines = []
        for kind in sorted({r.broker for r in late}):
            stock_p50: float | None = None
            for durable in (False, True):
                rows_ = [r for r in late if r.broker == kind and r.variant.durable is durable and not r.error]
                if rows_:
                    p50 = statistics.median(r.figures["p50"] for r in rows_)
                    # Issue 28's bound: a message landing on a queue the worker skips starts within
                    # stock's late pickup + 2 ms.
                    verdict = ""
                    if durable and stock_p50 is not None:
                        within = "within" if p50 <= stock_p50 + 2 else "NOT within"
                        verdict = f"**{p50 - stock_p50:+.1f} ms** ({within} stock + 2 ms)"
                    elif not durable:
                        stock_p50 = p50
                    lines.append([kind, rows_[0].variant.label, fmt(p50, 1),
                                  fmt(max(r.figures["max"] for r in rows_), 1),
                                  str(sum(r.figures["n"] for r in rows_)), verdict])
        table(["broker", "worker", "p50 (median of rounds)", "max", "samples", "durable p50 − stock p50"], lines)
        for r in late:
            if r.error:
                out.append(f"- FAILED {r.broker} {r.variant.label}: {r.error[:100]}")
        out.append("")

    iso_rows = by("isolation")
    if iso_rows:
        out.append(f"### 4. Isolation (one worker -c4 prefork; {iso[0]} × 1 s on bulk, then {iso[1]} × 10 ms "
                   "on interactive; interactive start − send, ms)")
        out.append("")
        lines = []
        for r in iso_rows:
            if r.error:
                lines.append([r.broker, r.variant.label, "FAILED", "", "", r.error[:80]])
                continue
            f = r.figures
            lines.append([r.broker, r.variant.label, fmt(f["min"], 1), fmt(f["p50"], 1), f"**{fmt(f['p99'], 1)}**",
                          fmt(f["max"], 1), str(f["bulk_started"])])
        table(["broker", "worker", "first", "p50", "p99", "max", "bulk tasks started by then"], lines)
        # The burst queues behind itself: with 2 slots free for it, the k-th
        # interactive task cannot start before floor(k/2) × 10 ms.
        own = [(k // 2) * 10.0 for k in range(iso[1])]
        out.append(f"A burst of {iso[1]} × 10 ms on the 2 slots `bulk` leaves free cannot do better than "
                   f"p50 ≈ {percentile(own, 50):.0f} ms, p99 ≈ {percentile(own, 99):.0f} ms (it queues behind "
                   "itself); `first` is the wait caused by the bulk backlog alone.")
        out.append("")
    return "\n".join(out)


def _code_state() -> str:
    """The commit measured, and whether the package had uncommitted edits (read-only git)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    worker = git("status", "--porcelain", "--", "celery_durable/worker", "celery_durable/planning").splitlines()
    other = git("status", "--porcelain", "--", "celery_durable").splitlines()
    state = f"commit {head}"
    if worker:
        state += f"; uncommitted edits in the worker: {', '.join(line[3:] for line in worker)}"
    else:
        state += "; worker/ and planning/ as committed"
    if len(other) > len(worker):
        state += f" ({len(other) - len(worker)} other files under celery_durable/ uncommitted)"
    return state


def write_report(path: Path, title: str, script: str, argv: Sequence[str] | None, facts: list[str],
                 report: str) -> None:
    """The tables as markdown under a header naming the command that made them and when."""
    command = f"/work/venv/bin/python benchmarks/{script} " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    header = [f"# {title}", "", f"- command: `{command}`",
              f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}", *facts, ""]
    path.write_text("\n".join(header) + "\n" + report + "\n")
    print(f"written to {path}")


# -- main ---------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker", choices=["redis", "rabbitmq", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="throughput rounds (default 3; 1 with --quick)")
    parser.add_argument("--scenarios", default="throughput,pickup,hol,isolation",
                        help="comma list of throughput,pickup,hol,isolation,queues,late")
    parser.add_argument("--write", metavar="PATH", help="also write the tables (markdown) to PATH")
    args = parser.parse_args(argv)

    count = 500 if args.quick else 5000
    rounds = args.rounds or (1 if args.quick else 3)
    samples = 30 if args.quick else 200
    iso = (16, 16) if args.quick else (40, 40)
    mq_count = 500 if args.quick else 2000
    late_count, late_samples = (3000, 10) if args.quick else (20000, 40)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    kinds = ["redis", "rabbitmq"] if args.broker == "all" else [args.broker]
    log_dir = Path(tempfile.mkdtemp(prefix="worker-bench-"))
    started = time.monotonic()
    print(f"worker logs: {log_dir}", flush=True)

    rows: list[Row] = []

    def attempt(
        scenario: str, broker: Broker, variant: Variant, fn: Callable[[], dict[str, Any]]
    ) -> dict[str, Any] | None:
        t0 = time.monotonic()
        try:
            figures = fn()
        except Exception as err:  # noqa: BLE001 - one variant failing (a broker restarted under us) ends only it
            reason = str(err) if isinstance(err, BenchFailed) else f"{type(err).__name__}: {err}"
            print(f"  {scenario:<10} {broker.kind:<8} {variant.label:<40} FAILED: {reason}", flush=True)
            rows.append(Row(scenario, broker.kind, variant, {}, (reason.splitlines() or ["?"])[0]))
            return None
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in figures.items()}
        print(f"  {scenario:<10} {broker.kind:<8} {variant.label:<40} {shown}  ({time.monotonic() - t0:.0f}s)",
              flush=True)
        return figures

    for kind in kinds:
        broker = Broker(kind, log_dir)
        problem = broker.check()
        if problem is not None:
            print(f"{kind}: not reachable ({problem}); skipped", file=sys.stderr)
            continue
        applicable = lambda vs: [v for v in vs if kind == "redis" or not v.redis_only]  # noqa: E731

        if "throughput" in scenarios:
            variants = applicable(throughput_variants())
            results: dict[Variant, list[dict[str, Any]]] = {v: [] for v in variants}
            failed: dict[Variant, str] = {}
            for _ in range(rounds):
                for v in variants:
                    if v in failed:
                        continue
                    figures = attempt("throughput", broker, v, lambda v=v: run_throughput(broker, v, count))
                    if figures is None:
                        failed[v] = rows.pop().error or "failed"
                    else:
                        results[v].append(figures)
            for v in variants:
                if v in failed:
                    rows.append(Row("throughput", kind, v, {}, failed[v]))
                else:
                    rows.append(Row("throughput", kind, v, {
                        "rates": [f["rate"] for f in results[v]],
                        "cpu_ms": [f["cpu_ms"] for f in results[v]],
                    }))
        if "pickup" in scenarios:
            for v in applicable(pickup_variants()):
                figures = attempt("pickup", broker, v, lambda v=v: run_pickup(broker, v, samples))
                if figures is not None:
                    rows.append(Row("pickup", kind, v, figures))
        if "hol" in scenarios:
            for v in applicable(hol_variants()):
                figures = attempt("hol", broker, v, lambda v=v: run_head_of_line(broker, v))
                if figures is not None:
                    rows.append(Row("hol", kind, v, figures))
        if "queues" in scenarios:
            for queue_count, spread in MANY_QUEUE_CASES:
                for _ in range(rounds):
                    for v in applicable(queues_variants()):
                        figures = attempt(f"queues{queue_count}{'s' if spread else ''}", broker, v,
                                          lambda v=v: run_many_queues(broker, v, mq_count, queue_count, spread))
                        if figures is not None:
                            rows.append(Row("queues", broker.kind, v, {**figures, "queues": queue_count,
                                                                       "spread": spread}))
        if "late" in scenarios:
            for _ in range(rounds):
                for v in applicable(many_queue_variants()):
                    figures = attempt("late", broker, v,
                                      lambda v=v: run_late_pickup(broker, v, late_count, 50, late_samples))
                    if figures is not None:
                        rows.append(Row("late", kind, v, figures))
        if "isolation" in scenarios:
            for v in applicable(isolation_variants()):
                figures = attempt("isolation", broker, v, lambda v=v: run_isolation(broker, v, *iso))
                if figures is not None:
                    rows.append(Row("isolation", kind, v, figures))

    report = render(rows, count=count, rounds=rounds, samples=samples, iso=iso)
    elapsed = time.monotonic() - started
    print()
    print(report)
    print(f"(total {elapsed:.0f} s; worker logs in {log_dir})")
    if args.write:
        write_report(Path(args.write), "Worker benchmark: `-P durable` vs stock Celery", "worker_bench.py", argv, [
            f"- machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}, "
            f"Celery {__import__('celery').__version__}, kombu {__import__('kombu').__version__}",
            f"- brokers: {', '.join(kinds)} (local); workers at `-l warning`, "
            f"`--without-mingle --without-gossip`; total run {elapsed:.0f} s",
            f"- code: {_code_state()}",
        ], report)
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
