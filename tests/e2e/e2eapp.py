"""The app the end-to-end workers run: every task records its start and end in Redis.

Configured from the environment by the harness (``tests/e2e/harness.py``):
E2E_BROKER, E2E_QUEUES (comma list, first is the default), E2E_CONF (JSON of
extra Celery settings), E2E_KEY (the Redis list events go to), E2E_OBSERVE.
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

_observer: dict[int, Any] = {}


def observe(event: str, label: str, **fields: Any) -> None:
    # One client per process: prefork children must not share the parent's socket.
    client = _observer.get(os.getpid())
    if client is None:
        client = redis.Redis.from_url(os.environ.get("E2E_OBSERVE", "redis://127.0.0.1:6379/15"))
        _observer[os.getpid()] = client
    record = {"e": event, "label": label, "t": time.time(), "pid": os.getpid(), **fields}
    client.rpush(os.environ["E2E_KEY"], json.dumps(record))


@app.task(name="e2e.record", bind=True)
def record(self: Any, label: str, seconds: float = 0.0, fail_times: int = 0) -> str:
    queue = (self.request.delivery_info or {}).get("routing_key")
    observe("start", label, id=self.request.id, queue=queue, retries=self.request.retries,
            redelivered=bool((self.request.delivery_info or {}).get("redelivered")))
    if seconds:
        time.sleep(seconds)
    observe("end", label, id=self.request.id, queue=queue)
    return label
