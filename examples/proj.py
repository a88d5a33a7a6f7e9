"""A small real app on three queues; runs on the embedded default or on servers named in the environment.

    DURABLE_STORE_URL    durable store: runs, steps, the outbox, and the demo's orders table
                         (default: an SQLite file here), e.g. postgresql+psycopg2://postgres@127.0.0.1/test
    DURABLE_BROKER_URL   broker (default: the broker that claims rows on the store's own database,
                         durable+<store URL>: no server needed on SQLite)
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
STORE_URL = os.environ.get("DURABLE_STORE_URL", f"sqlite:///{HERE}/durable-store.sqlite")

app = Celery(
    "proj",
    # The embedded default: messages are rows of the store's own file, claimed under leases (a killed
    # worker's tasks are taken over one lease later), and a task sent with outbox.enqueue is a row of
    # the caller's transaction.
    broker=os.environ.get("DURABLE_BROKER_URL", f"durable+{STORE_URL}"),
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
    durable_database_url=STORE_URL,
    # Run by `celery -A examples.proj beat -S celery_durable.Scheduler` on one host or several:
    # one replica leads, each tick is sent once, ticks missed while every replica was down follow
    # the entry's durable_catch_up ("skip" unless told).
    beat_schedule={
        "heartbeat": {"task": "examples.proj.heartbeat", "schedule": 1.0,
                      "options": {"durable_catch_up": "skip"}},
    },
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


def charge(order_id: int) -> dict[str, object]:
    """Stands in for a payment call: a step runs it once, whatever happens to the run after."""
    return {"id": f"ch_{order_id}", "amount": 10 * order_id}


def send_receipt(order_id: int, charge_id: str) -> str:
    return f"receipt for order {order_id} ({charge_id})"


@app.durable_task(bind=True, max_retries=3)
def fulfil(self, order_id: int) -> dict[str, object]:
    """A durable task: each step's result is checkpointed, so a retry or redelivery skips it."""
    paid = self.step("charge", charge, order_id)
    receipt = self.step("receipt", send_receipt, order_id, paid["id"])
    return {"order": order_id, "charge": paid["id"], "receipt": receipt}


@app.task(bind=True)
def heartbeat(self) -> str:
    """Sent every second by the durable beat; its task id names its tick (the same on every replica)."""
    return f"tick {(self.request.headers or {}).get('durable_beat_tick')}"

