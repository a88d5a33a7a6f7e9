"""System calls per task on a worker's main thread during the no-op throughput scenario (issue 28).

    .venv/bin/python benchmarks/syscalls_per_task.py "durable prefork -c2" [--broker rabbitmq] [--small 300 --big 3000]

Counted by ``perf stat -i`` on syscall tracepoints (no ptrace: the worker runs at its own speed, unlike
under ``strace -f``), on the process Celery's event loop runs in, not its pool children. Two runs, of
``--small`` and ``--big`` pre-loaded tasks: their difference divided by the extra tasks leaves boot and
shutdown out. The variant is a label of ``worker_bench.throughput_variants()``. Needs ``perf`` and
tracepoint access (root, or ``kernel.perf_event_paranoid`` ≤ 1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import worker_bench as wb

EVENTS = ("sendto", "write", "epoll_wait", "recvfrom", "read")


def counted_run(broker: wb.Broker, variant: wb.Variant, count: int, work_dir: Path) -> tuple[dict[str, int], float]:
    """One throughput run of ``count`` tasks under ``perf stat``: (calls per event, tasks/s)."""
    (queue,) = broker.queues("tp")
    key = f"bench:tp:{uuid.uuid4().hex}"
    counts_path = work_dir / f"perf-{uuid.uuid4().hex[:8]}.csv"
    worker = None
    try:
        broker.declare([queue])
        broker.preload(queue, "bench.noop", lambda i: [key], count)
        worker = wb.Worker(broker.url, [queue], variant, work_dir)
        # Made by Worker as a plain subprocess: replaced by the same command under perf.
        worker.process.kill()
        worker.process.wait()
        env = dict(os.environ, BENCH_BROKER=broker.url, BENCH_QUEUES=queue, BENCH_CONF=json.dumps(variant.conf),
                   BENCH_OBSERVE=wb.OBSERVE_URL, PYTHONPATH=os.pathsep.join([str(wb.HERE), str(wb.REPO)]))
        events = ",".join(f"syscalls:sys_enter_{event}" for event in EVENTS)
        worker._log = open(worker.log_path, "wb")  # closed by wait_exit, as the Worker's own log
        worker.process = subprocess.Popen(["perf", "stat", "-i", "-x,", "-o", str(counts_path), "-e", events,
                                           *worker.argv], cwd=wb.HERE, env=env, stdout=worker._log,
                                          stderr=subprocess.STDOUT)
        worker.wait_ready()
        seconds = wb.drain_seconds(broker, worker, key, count, f"{count} tasks")
    finally:
        if worker is not None:
            # SIGTERM to the worker, not to perf: perf writes its counts once the worker has exited.
            for child in wb.children_of(worker.process.pid):
                os.kill(child, 15)
            worker.wait_exit()
        broker.cleanup([queue], [worker] if worker else [], [f"{key}:n", f"{key}:first", f"{key}:last"])
    counts: dict[str, int] = {}
    for line in counts_path.read_text().splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2].startswith("syscalls:sys_enter_"):
            counts[fields[2].removeprefix("syscalls:sys_enter_")] = int(fields[0])
    return counts, count / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variant", help='a throughput variant label, e.g. "durable prefork -c2"')
    parser.add_argument("--broker", choices=["redis", "rabbitmq"], default="rabbitmq")
    parser.add_argument("--small", type=int, default=300)
    parser.add_argument("--big", type=int, default=3000)
    args = parser.parse_args(argv)
    variants = {variant.label: variant for variant in wb.throughput_variants()}
    if args.variant not in variants:
        parser.error(f"unknown variant; one of: {', '.join(variants)}")
    variant = variants[args.variant]
    with tempfile.TemporaryDirectory(prefix="syscalls-") as tmp:
        broker = wb.Broker(args.broker, Path(tmp))
        small, _ = counted_run(broker, variant, args.small, Path(tmp))
        big, rate = counted_run(broker, variant, args.big, Path(tmp))
    extra = args.big - args.small
    per_task = "  ".join(f"{event} {(big[event] - small[event]) / extra:.2f}" for event in EVENTS)
    load = open("/proc/loadavg").read().split()[0]
    print(f"{args.variant} ({args.broker}): per task {per_task}   ({rate:.0f} tasks/s at {args.big}; load {load})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
