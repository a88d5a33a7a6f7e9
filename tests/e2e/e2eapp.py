"""The app the end-to-end workers run: every task records its start and end in Redis.

Configured from the environment by the harness (``tests/e2e/harness.py``):
E2E_BROKER, E2E_QUEUES (comma list, first is the default), E2E_CONF (JSON of
extra Celery settings), E2E_KEY (the Redis list events go to), E2E_OBSERVE;
E2E_PROBED_EMPTY_FOR (seconds): how long the RabbitMQ claim passes trust a queue
they proved empty (planning/known_ready.py), for a test that must not be saved by a probe.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

import celery_durable

app = Celery("e2e", broker=os.environ.get("E2E_BROKER", "memory://"))
celery_durable.install(app)
_queues = os.environ.get("E2E_QUEUES", "celery").split(",")
app.conf.update(
    task_default_queue=_queues[0],
    worker_hijack_root_logger=True,
    broker_connection_retry_on_startup=True,
)
app.conf.update(json.loads(os.environ.get("E2E_CONF", "{}")))
if "E2E_PROBED_EMPTY_FOR" in os.environ:
    from celery_durable.planning import known_ready

    known_ready.PROBED_EMPTY_FOR = float(os.environ["E2E_PROBED_EMPTY_FOR"])

_observer: dict[int, Any] = {}


def _client() -> Any:
    # One client per process: prefork children must not share the parent's socket.
    client = _observer.get(os.getpid())
    if client is None:
        # No socket timeout: redis-py 8 reads with a 5 s one by default, which ended ``e2e.wait``'s BLPOP
        # (its own timeout 60 s) with a TimeoutError whenever a test held the gate shut for over 5 s.
        client = redis.Redis.from_url(os.environ.get("E2E_OBSERVE", "redis://127.0.0.1:6379/15"), socket_timeout=None)
        _observer[os.getpid()] = client
    return client


def observe(event: str, label: str, **fields: Any) -> None:
    record = {"e": event, "label": label, "t": time.time(), "pid": os.getpid(), **fields}
    _client().rpush(os.environ["E2E_KEY"], json.dumps(record))


@app.task(name="e2e.record", bind=True)
def record(self: Any, label: str, seconds: float = 0.0, fail_times: int = 0) -> str:
    queue = (self.request.delivery_info or {}).get("routing_key")
    observe("start", label, id=self.request.id, queue=queue, retries=self.request.retries,
            redelivered=bool((self.request.delivery_info or {}).get("redelivered")))
    if seconds:
        time.sleep(seconds)
    observe("end", label, id=self.request.id, queue=queue)
    return label


def _queue_of(task: Any) -> Any:
    return (task.request.delivery_info or {}).get("routing_key")


@app.task(name="e2e.wait", bind=True)
def wait(self: Any, label: str, gate: str, timeout: float = 60.0) -> str:
    """Runs until the harness opens ``gate`` (one token per waiter): a long task that ends on cue."""
    queue = _queue_of(self)
    observe("start", label, id=self.request.id, queue=queue, retries=self.request.retries)
    opened = _client().blpop(f"{os.environ['E2E_KEY']}:gate:{gate}", timeout=timeout)
    observe("end", label, id=self.request.id, queue=queue, opened=opened is not None)
    return label


@app.task(name="e2e.limited", bind=True, rate_limit="5/s")
def limited(self: Any, label: str) -> str:
    """Rate-limited to 5 a second in each worker."""
    queue = _queue_of(self)
    observe("start", label, id=self.request.id, queue=queue)
    observe("end", label, id=self.request.id, queue=queue)
    return label


@app.task(name="e2e.flaky", bind=True, max_retries=5)
def flaky(self: Any, label: str, fail_times: int = 2) -> str:
    """Retries (at once) ``fail_times`` times, then succeeds; attempts are counted in Redis by label."""
    queue = _queue_of(self)
    attempt = int(_client().incr(f"{os.environ['E2E_KEY']}:attempts:{label}"))
    observe("start", label, id=self.request.id, queue=queue, retries=self.request.retries, attempt=attempt)
    if attempt <= fail_times:
        observe("retry", label, id=self.request.id, queue=queue, attempt=attempt)
        raise self.retry(countdown=0)
    observe("end", label, id=self.request.id, queue=queue, attempt=attempt)
    return label


@app.task(name="e2e.reject", bind=True, acks_late=True)
def reject(self: Any, label: str) -> None:
    """Rejects its own message without requeueing it (acks_late, so the reject is what settles it)."""
    from celery.exceptions import Reject

    observe("start", label, id=self.request.id, queue=_queue_of(self))
    observe("reject", label, id=self.request.id, queue=_queue_of(self))
    raise Reject("e2e rejects this message", requeue=False)


@app.task(name="e2e.limited_slow", bind=True, rate_limit="30/m")
def limited_slow(self: Any, label: str) -> str:
    """Rate-limited to one every 2 seconds in each worker: the second waits in its token bucket."""
    queue = _queue_of(self)
    observe("start", label, id=self.request.id, queue=queue)
    observe("end", label, id=self.request.id, queue=queue)
    return label
