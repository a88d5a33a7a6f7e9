"""The app the durable end-to-end workers run: durable tasks whose side effects are counted in a table.

Configured like ``e2eapp`` (E2E_BROKER, E2E_QUEUES, E2E_CONF, E2E_KEY, E2E_OBSERVE);
``durable_database_url`` comes in E2E_CONF. Effects go to ``e2e_effects`` in the
durable store's database, outside any checkpoint transaction, so a step's fn
that ran twice shows up as two rows.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from celery import Celery

import celery_durable
from celery_durable.store.engine import autocommit, engine_for
from tests.e2e.e2eapp import _client, observe

app = Celery("durable-e2e", broker=os.environ.get("E2E_BROKER", "memory://"))
celery_durable.install(app)
_queues = os.environ.get("E2E_QUEUES", "celery").split(",")
app.conf.update(task_default_queue=_queues[0], worker_hijack_root_logger=True,
                broker_connection_retry_on_startup=True)
app.conf.update(json.loads(os.environ.get("E2E_CONF", "{}")))

EFFECTS_DDL = "CREATE TABLE IF NOT EXISTS e2e_effects (run_id VARCHAR(255), step VARCHAR(64))"


def effect(run_id: str, step: str) -> str:
    with autocommit(engine_for(app.conf.durable_database_url)).connect() as conn:
        conn.execute(sa.text("INSERT INTO e2e_effects (run_id, step) VALUES (:r, :s)"), {"r": run_id, "s": step})
    return step


def _key(suffix: str) -> str:
    return f"{os.environ['E2E_KEY']}:{suffix}"


def _settled(run: Any) -> None:
    observe("settled", run.id, state=run.state, error=run.last_error)


@app.durable_task(bind=True, name="durable.three_steps", max_retries=3, default_retry_delay=0,
                  on_settled=_settled)
def three_steps(self: Any, label: str) -> str:
    run_id = self.request.id
    self.step("s1", effect, run_id, "s1")
    self.step("s2", effect, run_id, "s2")
    if int(_client().incr(_key(f"attempt:{run_id}"))) == 1:
        # Step 2 has committed: the test SIGKILLs the worker while this waits.
        observe("after-s2", label, id=run_id, pid=os.getpid())
        _client().blpop(_key(f"gate:{label}"), timeout=60)
    self.step("s3", effect, run_id, "s3")
    observe("end", label, id=run_id)
    return label


@app.durable_task(bind=True, name="durable.sleeper")
def sleeper(self: Any, label: str, seconds: float) -> str:
    run_id = self.request.id
    observe("exec", label, id=run_id)
    self.step("before", effect, run_id, "before")
    self.sleep("nap", seconds)
    self.step("after", effect, run_id, "after")
    observe("woke", label, id=run_id)
    return label


@app.durable_task(bind=True, name="durable.guarded_sleeper")
def guarded_sleeper(self: Any, label: str, seconds: float) -> str:
    run_id = self.request.id
    observe("exec", label, id=run_id)
    try:
        celery_durable.sleep("nap", seconds)
    except Exception:  # noqa: BLE001 - the broad except under test
        # A body's broad except, as user code writes it: the sleep's hand-off must pass through it.
        observe("swallowed", label, id=run_id)
    self.step("after", effect, run_id, "after")
    observe("woke", label, id=run_id)
    return label


@app.durable_task(bind=True, name="durable.quick", on_settled=_settled)
def quick(self: Any, label: str) -> str:
    observe("start", label, id=self.request.id)
    observe("end", label, id=self.request.id)
    return label


def _ship(run_id: str) -> str:
    if not _client().get(_key("carrier-fixed")):
        raise RuntimeError("carrier rejected the parcel")
    return effect(run_id, "ship")


@app.durable_task(bind=True, name="durable.doomed", max_retries=1, default_retry_delay=0, on_settled=_settled)
def doomed(self: Any, label: str) -> str:
    self.step("charge", effect, self.request.id, "charge")
    return self.step("ship", _ship, self.request.id)


def _slow_effect(run_id: str, step: str, seconds: float) -> str:
    import time

    time.sleep(seconds)  # the step's work: long enough to outlive a visibility timeout or a lease
    return effect(run_id, step)


@app.durable_task(bind=True, name="durable.long_steps", max_retries=3, default_retry_delay=0,
                  on_settled=_settled)
def long_steps(self: Any, label: str, count: int, seconds: float) -> str:
    run_id = self.request.id
    observe("exec", label, id=run_id, pid=os.getpid())
    for n in range(count):
        self.step(f"s{n}", _slow_effect, run_id, f"s{n}", seconds)
    observe("end", label, id=run_id)
    return label


@app.durable_task(bind=True, name="durable.self_killer", max_retries=2, default_retry_delay=0,
                  on_settled=_settled)
def self_killer(self: Any, label: str) -> str:
    # As an OOM kill or a segfault in a C extension would: the pool child dies mid-run, every time,
    # until the test lets it live.
    observe("exec", label, id=self.request.id, pid=os.getpid())
    if not _client().get(_key(f"spare:{label}")):
        os._exit(9)
    observe("end", label, id=self.request.id)
    return label


def _counted(label: str, step: str, seconds: float) -> str:
    import time

    # Counted outside the store (in the observer), so it is seen even while the store is down.
    observe("effect", label, step=step)
    time.sleep(seconds)
    return step


def _ledger_row(conn: Any, run_id: str) -> str:
    conn.execute(sa.text("INSERT INTO e2e_effects (run_id, step) VALUES (:r, 'ledger')"), {"r": run_id})
    return "ledger"


@app.durable_task(bind=True, name="durable.outage_steps", max_retries=1, default_retry_delay=0,
                  on_settled=_settled)
def outage_steps(self: Any, label: str, seconds: float) -> str:
    observe("exec", label, id=self.request.id, retries=self.request.retries)
    self.step("first", _counted, label, "first", seconds)
    self.step("ledger", _ledger_row, self.request.id, transactional=True)
    self.step("second", _counted, label, "second", seconds)
    observe("end", label, id=self.request.id, retries=self.request.retries)
    return label


@app.durable_task(bind=True, name="durable.soak", max_retries=10, default_retry_delay=0)
def soak(self: Any, label: str, first_seconds: float, last_seconds: float) -> str:
    # The soak (tests/soak): a plain step, a transactional one, a plain one. The plain steps'
    # effects go to the observer with the pid that ran them (``_counted``), so a duplicate can be
    # traced to the process that was killed inside it.
    self.step("first", _counted, label, "first", first_seconds)
    self.step("ledger", _ledger_row, self.request.id, transactional=True)
    self.step("last", _counted, label, "last", last_seconds)
    return label


@app.task(bind=True, name="durable.plain_held", acks_late=True)
def plain_held(self: Any, label: str) -> str:
    """A plain ``acks_late`` task: its first attempt waits (the test kills its worker), later ones end."""
    observe("exec", label, id=self.request.id, pid=os.getpid())
    if int(_client().incr(_key(f"attempt:{self.request.id}"))) == 1:
        _client().blpop(_key(f"gate:{label}"), timeout=60)
    observe("end", label, id=self.request.id)
    return label


@app.task(name="durable.plain")
def plain(label: str) -> str:
    observe("plain", label)
    return label
#: Step names the steps table cannot hold, by the kind a test asks for (built here: a
#: lone surrogate could not even be sent as a task argument).
BAD_STEP_NAMES = {"nul": "bad\x00name", "surrogate": "bad\ud800name", "too-long": "x" * 201}


@app.durable_task(bind=True, name="durable.bad_step_name", max_retries=3, default_retry_delay=0,
                  on_settled=_settled)
def bad_step_name(self: Any, kind: str) -> str:
    observe("start", kind, id=self.request.id)
    # effect() writes a row each time it runs: the test asserts there is none.
    return str(self.step(BAD_STEP_NAMES[kind], effect, self.request.id, kind))


def _next_day(when: dt.datetime) -> dt.datetime:
    return when + dt.timedelta(days=1)


@app.durable_task(bind=True, name="durable.typed", max_retries=0, on_settled=_settled)
def typed(self: Any, when: dt.datetime, ident: uuid.UUID, amount: Decimal, blob: bytes) -> dict[str, Any]:
    """Arguments Celery's JSON carries typed, and a step that returns a datetime."""
    later = self.step("next day", _next_day, when)
    observe("typed", self.request.id, types=[type(v).__name__ for v in (when, ident, amount, blob, later)])
    return {"later": later, "ident": ident, "amount": amount, "blob": blob}


@app.task(name="durable.plain_fails")
def plain_fails(label: str) -> str:
    """A plain task that always raises (the per-task metrics count it failed, with its exception's class)."""
    raise ValueError(label)


@app.task(bind=True, name="durable.plain_retries", max_retries=3)
def plain_retries(self: Any, label: str) -> str:
    """A plain task that asks to be retried once, then succeeds."""
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return label


@app.task(name="durable.plain_overruns", time_limit=1)
def plain_overruns(label: str) -> str:
    """A plain task the hard time limit kills (prefork)."""
    import time

    time.sleep(30)
    return label


@app.task(name="durable.plain_dies")
def plain_dies(label: str) -> str:
    """A plain task whose pool child dies under it (WorkerLostError in the worker)."""
    os._exit(1)


@app.task(name="durable.plain_rejects", acks_late=True)
def plain_rejects(label: str) -> str:
    """A plain task that rejects its message for good (Celery records it as a failure)."""
    from celery.exceptions import Reject

    raise Reject(label, requeue=False)


@app.task(bind=True, name="durable.plain_blocks")
def plain_blocks(self: Any, label: str) -> str:
    """A plain task that runs until a test revokes it with terminate (prefork), or 60 s."""
    observe("start", label, id=self.request.id)
    _client().blpop(_key(f"gate:{label}"), timeout=60)
    return label
