"""The app outbox end-to-end processes run: ``durableapp`` plus a task that records its run once, and a relay stall.

``e2e_relay_stall_after`` in E2E_CONF makes a relay process stop (until killed)
on its Nth pass that published anything: the batch is on the broker, not marked.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import sqlalchemy as sa

from celery_durable import faults
from tests.e2e.durableapp import app, observe
from tests.e2e.e2eapp import _client

__all__ = ["app"]


def _record(conn: Any, run_id: str) -> str:
    conn.execute(sa.text("INSERT INTO e2e_effects (run_id, step) VALUES (:r, 'outbox')"), {"r": run_id})
    return run_id


@app.durable_task(bind=True, name="durable.outbox_record", max_retries=5, default_retry_delay=0)
def outbox_record(self: Any, label: str) -> str:
    # Transactional: the effect commits with its checkpoint, so two overlapping
    # deliveries of one task id leave one row.
    return self.step("record", _record, self.request.id, transactional=True)


def _observe_step(task: Any, previous: list[str], label: str) -> None:
    request = task.request
    observe("start", label, id=request.id, root_id=request.root_id, parent_id=request.parent_id, got=previous)
    # Counts the runs of each task id: a step started twice under one id shows up here.
    _client().incr(f"{os.environ['E2E_KEY']}:runs:{request.id}")
    observe("end", label, id=request.id)


def _append(previous: list[str], label: str) -> list[str]:
    return [*previous, label]


@app.task(bind=True, name="outbox.chain_step")
def chain_step(self: Any, previous: list[str], label: str) -> list[str]:
    """A plain step of an outbox chain: records its ids and what the previous step returned."""
    _observe_step(self, previous, label)
    return _append(previous, label)


@app.durable_task(bind=True, name="durable.outbox_chain_step")
def durable_chain_step(self: Any, previous: list[str], label: str) -> list[str]:
    """The same as a durable task: its result, from a checkpointed step, feeds the next one."""
    _observe_step(self, previous, label)
    return self.step("append", _append, previous, label)


_stall_after = app.conf.get("e2e_relay_stall_after")
if _stall_after:
    _published = 0
    _lock = threading.Lock()

    def _stall(point: str) -> None:
        global _published
        if point != faults.RELAY_AFTER_PUBLISH:
            return
        with _lock:
            _published += 1
            if _published != int(_stall_after):
                return
        observe("relay-stalled", "relay", pid=os.getpid())
        threading.Event().wait()  # held here, batch unmarked, until the test SIGKILLs the process

    faults.install(app, _stall)
