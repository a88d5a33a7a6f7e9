"""The claim's burial: a row whose holders keep dying past its task's budget is settled dead, never handed out.

The rule of the jobs library this project ports: a lease that lapsed on a
message's final attempt is settled by the claim itself, since no body will run
to settle it. The budget is Celery's: a message of a task with ``max_retries``
n that already carries ``retries`` r may be handed to n + 1 − r holders; the
hand-out after that many died is the claim's to bury. A durable task's run is
settled ``dead`` (as ``RunExhausted`` buries one a worker started), a plain
task's row goes to ``<queue>.durable.parked`` with a reason header. Each is
logged and counted ``jobs_total{outcome="dead_lettered"}``; none is deleted silently. The task's
result becomes FAILURE (``RunExhausted``) in the app's result backend, as stock Celery records
``WorkerLostError`` for a task whose process died: ``AsyncResult.get()`` raises instead of waiting forever.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from typing import Any

from kombu.serialization import loads, prepare_accept_content

from celery_durable.errors import RunExhausted
from celery_durable.headers import (
    PARKED_FROM_HEADER,
    PARKED_REASON_HEADER,
    PARKED_SUFFIX,
    TASK_ID_HEADER,
    TASK_NAME_HEADER,
    TASK_RETRIES_HEADER,
)
from celery_durable.metrics import jobs as metrics
from celery_durable.store import runs
from celery_durable.store.engine import autocommit, ensure_schema, store_url, unavailable_as_error
from celery_durable.tasks.durable import DurableTask
from celery_durable.tasks.execution import call_hook

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Burial:
    """What the claim does with a spent row: ``settled`` (a durable run settled dead: delete the row) or
    ``park`` (move it, with ``payload``'s reason header, to the parking queue)."""

    kind: str
    payload: dict[str, Any]


SETTLED, PARK = "settled", "park"


def spent(app: Any, payload: dict[str, Any], lapses: int) -> tuple[Any, str] | None:
    """The task and why, when ``lapses`` dead holders spent the message's budget; None while some is left."""
    if lapses <= 0:
        return None
    headers = payload.get("headers") or {}
    task = app.tasks.get(headers.get(TASK_NAME_HEADER)) if app is not None else None
    if task is None or task.max_retries is None:
        return None  # a task this worker does not know, or no limit: Celery's own handling
    retries = int(headers.get(TASK_RETRIES_HEADER) or 0)
    if retries + lapses <= int(task.max_retries):
        return None
    return task, (f"handed out {retries + lapses} times (max_retries={task.max_retries}) "
                  f"and every holder died before it ended")


def bury(app: Any, queue: str, payload: dict[str, Any], lapses: int) -> Burial | None:
    """Settle a spent message dead (None: it has budget left, or its run could not be settled: deliver it)."""
    found = spent(app, payload, lapses)
    if found is None:
        return None
    task, reason = found
    headers = payload.get("headers") or {}
    if isinstance(task, DurableTask):
        return _settle_run(task, queue, payload, headers, reason)
    logger.error("durable.broker.dead task=%s id=%s queue=%s: %s; moved to %s", task.name,
                 headers.get(TASK_ID_HEADER), queue, reason, queue + PARKED_SUFFIX,
                 extra={"event": "durable.broker.dead", "task": task.name, "task_id": headers.get(TASK_ID_HEADER),
                        "queue": queue, "lapses": lapses})
    metrics.count(queue, "dead_lettered")
    _record_failure(task, headers.get(TASK_ID_HEADER), reason)
    parked = dict(payload)
    parked["headers"] = {**headers, PARKED_FROM_HEADER: queue, PARKED_REASON_HEADER: f"RunExhausted: {reason}"}
    return Burial(PARK, parked)


def _settle_run(task: Any, queue: str, payload: dict[str, Any], headers: dict[str, Any],
                reason: str) -> Burial | None:
    run_id = str(headers.get(TASK_ID_HEADER))
    args, kwargs = _arguments(payload, prepare_accept_content(task.app.conf.accept_content))
    url = store_url(task.app)
    try:
        with unavailable_as_error(url), autocommit(ensure_schema(url)).connect() as conn:
            settled = runs.bury(conn, run_id=run_id, task_name=task.name, queue=queue, args=json.dumps(args),
                                kwargs=json.dumps(kwargs), reason=f"RunExhausted: {reason}")
    except Exception as err:  # noqa: BLE001 - delivered instead: the run's own admission buries it on start
        logger.warning("durable.broker.dead_deferred task=%s id=%s: the store could not settle it (%s)",
                       task.name, run_id, err,
                       extra={"event": "durable.broker.dead_deferred", "task": task.name, "run_id": run_id})
        return None
    if settled is not None:
        logger.error("durable.run.exhausted task=%s id=%s: %s (settled by the broker's claim)", task.name,
                     run_id, reason, extra={"event": "durable.run.exhausted", "task": task.name, "run_id": run_id,
                                            "queue": queue})
        metrics.count(queue, "dead_lettered")
        _record_failure(task, run_id, reason)
        call_hook(task, settled)
    # Not settled now: it had settled already, or a live attempt holds the run — the message is spent either way.
    return Burial(SETTLED, payload)


def _record_failure(task: Any, task_id: Any, reason: str) -> None:
    """FAILURE with ``RunExhausted`` in the result backend, unless the task keeps no result or there is none."""
    if task_id is None or getattr(task, "ignore_result", False):
        return
    try:
        task.backend.mark_as_failure(str(task_id), RunExhausted(reason))
    except NotImplementedError:
        pass  # no result backend configured: the log line and the counter say it
    except Exception as err:  # noqa: BLE001 - the burial stands; the result backend is told nothing more
        logger.warning("durable.broker.dead_result_failed id=%s: the result backend did not take the FAILURE (%s)",
                       task_id, err, extra={"event": "durable.broker.dead_result_failed", "task_id": str(task_id)})


def _arguments(payload: dict[str, Any], accept: Any) -> tuple[list[Any], dict[str, Any]]:
    """A protocol-2 task message's (args, kwargs), for the dead run's row (``runs requeue`` resends them)."""
    properties = payload.get("properties") or {}
    body: Any = payload.get("body")
    try:
        if properties.get("body_encoding") == "base64":
            body = base64.b64decode(body)
        decoded = loads(body, payload.get("content-type"), payload.get("content-encoding") or "utf-8",
                        accept=accept)
        args, kwargs = decoded[0], decoded[1]
        if isinstance(args, list) and isinstance(kwargs, dict):
            return args, kwargs
    except Exception:  # noqa: BLE001 - an unreadable body is buried with no arguments, not left to loop
        pass
    return [], {}
