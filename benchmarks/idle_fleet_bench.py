"""What the Redis idle wait costs when several workers wait on one queue: a message at a time.

    .venv/bin/python benchmarks/idle_fleet_bench.py [--workers 3] [--samples 200] [--write PATH]

``-P durable`` waits on Redis with a blocking peek that takes nothing (worker/redis_idle_wait.py):
every idle worker is woken by each message, runs a claim pass, and one of them takes it. Stock
Celery's BRPOP wakes one worker, and takes the message off its list before the worker has read it
(a worker killed then loses it). This prices the difference beside stock, in one run on the same
Redis: pickup latency (task start − send) and Redis commands per message (``INFO commandstats``
before and after, server-wide: run it on a quiet Redis; the benchmark's own BLPOP per sample and
the task's one tally call are the same on both sides).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from worker_bench import BenchFailed, Broker, Variant, Worker, percentile, stop_all, write_report  # noqa: E402


def variants() -> list[Variant]:
    return [
        Variant("stock prefork -c2", "prefork", 2),
        Variant("durable prefork -c2", "durable", 2, {"durable_max_in_flight": 2}),
    ]


def commands_total(client: Any) -> int:
    return sum(int(stat["calls"]) for stat in client.info("commandstats").values())


def run(broker: Broker, variant: Variant, workers: int, samples: int, warmup: int = 10,
        pause: float = 0.05) -> dict[str, Any]:
    (queue,) = broker.queues("idle-fleet")
    key = f"bench:idle-fleet:{uuid.uuid4().hex}"
    started: list[Worker] = []
    server = redis.Redis.from_url(broker.url)
    try:
        for _ in range(workers):
            started.append(broker.worker([queue], variant))
        for w in started:
            w.wait_ready()
        latencies = []
        commands = 0
        with broker.app.producer_or_acquire() as producer:
            for i in range(warmup + samples):
                # Every worker is idle again before each send (the pause covers the ack and re-arm).
                time.sleep(pause)
                before = commands_total(server)
                sent = time.time()
                broker.app.send_task("bench.ping", args=[key, sent], queue=queue, producer=producer)
                got = broker.observer.blpop([key], timeout=30)
                if got is None:
                    for w in started:
                        w.check_alive()
                    raise BenchFailed(f"sample {i}: the task did not run within 30 s")
                # The woken workers that found nothing finish their passes within the pause.
                time.sleep(pause)
                if i >= warmup:
                    latencies.append(float(got[1]) * 1000)
                    commands += commands_total(server) - before - 1  # less the INFO call itself
        return {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99),
                "commands": commands / samples, "n": len(latencies)}
    finally:
        stop_all(started)
        broker.cleanup([queue], started, [key])
        server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--write", metavar="PATH")
    args = parser.parse_args(argv)
    broker = Broker("redis", Path(tempfile.mkdtemp(prefix="idle-fleet-")))
    problem = broker.check()
    if problem:
        print(f"Redis not reachable: {problem}", file=sys.stderr)
        return 2
    lines = [f"### Idle fleet: {args.workers} idle workers on one queue, one message at a time "
             f"({args.samples} samples)", "",
             "| worker | pickup p50 ms | p99 ms | Redis commands per message |", "|---|---|---|---|"]
    for variant in variants():
        figures = run(broker, variant, args.workers, args.samples)
        lines.append(f"| {variant.label} | {figures['p50']:.2f} | {figures['p99']:.2f} | {figures['commands']:.1f} |")
        print(lines[-1], flush=True)
    report = "\n".join(lines)
    print(report)
    if args.write:
        write_report(Path(args.write), "The Redis idle wait beside stock BRPOP: an idle fleet",
                     "idle_fleet_bench.py", argv, [f"- workers: {args.workers} × prefork -c2, local Redis"], report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
