"""An app that never imports celery_durable: ``-P durable`` must resolve through the CLI entry point.

Configured from the same environment as ``e2eapp`` (E2E_BROKER, E2E_QUEUES, E2E_CONF, E2E_KEY,
E2E_OBSERVE) and records the same start/end events, so the harness reads it alike.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

app = Celery("e2e-plain", broker=os.environ.get("E2E_BROKER", "memory://"))
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
def record(self: Any, label: str, seconds: float = 0.0) -> str:
    queue = (self.request.delivery_info or {}).get("routing_key")
    observe("start", label, id=self.request.id, queue=queue)
    if seconds:
        time.sleep(seconds)
    observe("end", label, id=self.request.id, queue=queue)
    return label
