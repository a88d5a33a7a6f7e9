"""The app of the fleet-limit end-to-end tests: tasks that declare limits and record when they run.

Built on ``e2eapp`` (its app, its settings from the environment, its Redis
event list): each task records ``start``/``end`` with its label, id, pid and
retries, so a test reads the concurrency the tasks themselves saw. The rate
of ``limits.partner`` comes from E2E_RATE ("100/m" unless told).
"""

from __future__ import annotations

import os
import time
from typing import Any

from tests.e2e.e2eapp import _client, _queue_of, app, observe


def _run(task: Any, label: str, seconds: float) -> str:
    observe("start", label, id=task.request.id, queue=_queue_of(task), retries=task.request.retries)
    if seconds:
        time.sleep(seconds)
    observe("end", label, id=task.request.id, queue=_queue_of(task))
    return label


@app.task(name="limits.export", bind=True, durable_concurrency=int(os.environ.get("E2E_EXPORT_CONCURRENCY", "3")),
          acks_late=True)
def export(self: Any, label: str, seconds: float = 0.0) -> str:
    """At most 3 at once across every worker (E2E_EXPORT_CONCURRENCY: another number, as a rolling deploy
    changing it would); acked late, so a killed worker's run is delivered again."""
    return _run(self, label, seconds)


@app.task(name="limits.export_free", bind=True, acks_late=True)
def export_free(self: Any, label: str, seconds: float = 0.0) -> str:
    """``limits.export`` without its limit: what the benchmark measures the limit's cost against."""
    return _run(self, label, seconds)


@app.durable_task(bind=True, name="limits.sync_org", durable_key=lambda org, *a, **kw: f"org:{org}",
                  durable_key_limit=1, durable_when_busy="wait")
def sync_org(self: Any, org: str, label: str, seconds: float = 0.0) -> str:
    """One run per org at a time; the others wait their turn (a durable task)."""
    return _run(self, label, seconds)


@app.task(name="limits.sync_plain", bind=True, durable_key=lambda org, *a, **kw: f"org:{org}",
          durable_key_limit=1, max_retries=0)
def sync_plain(self: Any, org: str, label: str, seconds: float = 0.0) -> str:
    """The same key limit on a plain task with no retries to spend: waiting must not spend one."""
    return _run(self, label, seconds)


@app.task(name="limits.debounce", bind=True, durable_key=lambda org, *a, **kw: f"org:{org}",
          durable_when_busy="drop")
def debounce(self: Any, org: str, label: str, seconds: float = 0.0) -> str:
    """One run per org; a message for a busy org is dropped."""
    return _run(self, label, seconds)


@app.task(name="limits.gated", bind=True, durable_concurrency=1)
def gated(self: Any, label: str, gate: str = "gate") -> str:
    """Concurrency 1, ends when the test opens ``gate``: holds its lease as long as the test wants."""
    observe("start", label, id=self.request.id, queue=_queue_of(self), retries=self.request.retries)
    _client().blpop(f"{os.environ['E2E_KEY']}:gate:{gate}", timeout=60)
    observe("end", label, id=self.request.id, queue=_queue_of(self))
    return label


@app.task(name="limits.partner", bind=True, durable_rate_limit=os.environ.get("E2E_RATE", "100/m"))
def partner(self: Any, label: str) -> str:
    """Fleet-wide rate limited."""
    return _run(self, label, 0.0)


def _key_that_fails(org: Any, *args: Any, **kwargs: Any) -> str:
    if org == "boom":
        raise ValueError("no org named boom")
    return f"org:{org}"


@app.task(name="limits.fragile_key", bind=True, durable_key=_key_that_fails)
def fragile_key(self: Any, org: str, label: str) -> str:
    """Its key function raises for org "boom": that run fails, named, and never runs."""
    return _run(self, label, 0.0)


@app.durable_task(bind=True, name="limits.stepped")
def stepped(self: Any, label: str) -> str:
    """A durable run with no limit and one checkpointed step: its lease, step and outcome go to the store."""
    self.step("observed", observe, "step", label, id=self.request.id)
    return _run(self, label, 0.0)
