"""The app the benchmark's workers run: tasks that record what the benchmark measures, cheaply.

Configured from the environment by ``benchmarks/worker_bench.py``:
BENCH_BROKER (broker URL), BENCH_QUEUES (comma list, first is the default),
BENCH_CONF (JSON of extra Celery settings), BENCH_OBSERVE (the Redis the tasks
record into). Every record is ONE Redis round trip per task, the same for
stock and durable workers, so it weighs equally on both sides of a ratio.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import redis
from celery import Celery, signals

import celery_durable

app = Celery("bench", broker=os.environ.get("BENCH_BROKER", "memory://"))
celery_durable.install(app)
_queues = os.environ.get("BENCH_QUEUES", "celery").split(",")
app.conf.update(
    task_default_queue=_queues[0],
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
)
app.conf.update(json.loads(os.environ.get("BENCH_CONF", "{}")))

# min(first start), max(last end) and a count, in one round trip.
_TALLY = """
local n = redis.call('INCR', KEYS[1])
local s = redis.call('GET', KEYS[2])
if (not s) or tonumber(s) > tonumber(ARGV[1]) then redis.call('SET', KEYS[2], ARGV[1]) end
local e = redis.call('GET', KEYS[3])
if (not e) or tonumber(e) < tonumber(ARGV[2]) then redis.call('SET', KEYS[3], ARGV[2]) end
return n
"""

_clients: dict[int, Any] = {}


def _observer() -> Any:
    # One client per process: prefork children must not share the parent's socket.
    pid = os.getpid()
    entry = _clients.get(pid)
    if entry is None:
        client = redis.Redis.from_url(os.environ.get("BENCH_OBSERVE", "redis://127.0.0.1:6379/15"))
        entry = _clients[pid] = (client, client.register_script(_TALLY))
    return entry


@signals.worker_ready.connect
def _announce_ready(sender: Any = None, **_: Any) -> None:
    # Workers run at -l warning (no per-task log lines to weigh on the figures),
    # which hides Celery's own "<name> ready." INFO line: say it at WARNING.
    hostname = getattr(sender, "hostname", None) or getattr(getattr(sender, "controller", None), "hostname", "?")
    logging.getLogger("bench").warning("%s ready.", hostname)


@app.task(name="bench.noop")
def noop(key: str) -> None:
    """Throughput: tally count, first start and last end."""
    started = time.time()
    _, tally = _observer()
    tally(keys=[f"{key}:n", f"{key}:first", f"{key}:last"], args=[repr(started), repr(time.time())])


@app.task(name="bench.ping")
def ping(key: str, sent: float) -> None:
    """Pickup latency: start − send, pushed to the list the benchmark BLPOPs."""
    latency = time.time() - sent
    client, _ = _observer()
    client.rpush(key, repr(latency))


@app.task(name="bench.work")
def work(key: str, label: str, sent: float, seconds: float) -> None:
    """Head-of-line and isolation: the start latency is recorded at start, then the task sleeps."""
    latency = time.time() - sent
    client, _ = _observer()
    client.rpush(key, json.dumps({"label": label, "latency": latency}))
    if seconds:
        time.sleep(seconds)


# -- durable-task throughput (benchmarks/durable_task_bench.py) ------------------------------
def _unit(i: int) -> int:
    """The work each step wraps: trivial, so the difference measured is the checkpointing."""
    return i + 1


def _tally(key: str, started: float) -> None:
    _, tally = _observer()
    tally(keys=[f"{key}:n", f"{key}:first", f"{key}:last"], args=[repr(started), repr(time.time())])


@app.task(name="bench.plain3")
def plain3(key: str, i: int) -> int:
    """Three calls of the unit of work, then the tally: the plain task beside ``durable3``."""
    started = time.time()
    total = _unit(i) + _unit(i) + _unit(i)
    _tally(key, started)
    return total


@app.durable_task(bind=True, name="bench.durable3")
def durable3(self: Any, key: str, i: int) -> int:
    """The same three calls as ``plain3``, each a checkpointed step."""
    started = time.time()
    total = self.step("a", _unit, i) + self.step("b", _unit, i) + self.step("c", _unit, i)
    _tally(key, started)
    return total
