"""A small real app on three queues; runs on the embedded default or on servers named in the environment.

    DURABLE_BROKER_URL   broker (default: an SQLite file here, no server needed)
                         e.g. redis://127.0.0.1:6379/0 or amqp://guest:guest@127.0.0.1:5672//
    DURABLE_RESULT_URL   result backend (default: an SQLite file here)
                         e.g. db+postgresql://postgres@127.0.0.1/test
"""

from __future__ import annotations

import os
import time

from celery import Celery

import celery_durable

HERE = os.path.dirname(os.path.abspath(__file__))

app = Celery(
    "proj",
    broker=os.environ.get("DURABLE_BROKER_URL", f"sqla+sqlite:///{HERE}/durable-broker.sqlite"),
    backend=os.environ.get("DURABLE_RESULT_URL", f"db+sqlite:///{HERE}/durable-results.sqlite"),
)
celery_durable.install(app)
app.conf.update(
    task_default_queue="default",
    task_routes={
        "examples.proj.send_email": {"queue": "emails"},
        "examples.proj.build_report": {"queue": "reports"},
    },
    task_acks_late=True,
    durable_max_in_flight=4,
    durable_queue_concurrency={"reports": 1},
)


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task
def send_email(to: str) -> str:
    time.sleep(0.05)
    return f"sent to {to}"


@app.task
def build_report(name: str) -> str:
    time.sleep(0.3)
    return f"report {name} built"
