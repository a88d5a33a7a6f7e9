"""Revoking a durable task cancels its run: settled ``cancelled``, counted, handed to ``on_settled``.

Celery announces every revoke of a request (discarded at receipt or before
the pool got it, a revoked ETA or durable-sleep wake-up, a ``terminate=True``
of a running one, an expired one) with the ``task_revoked`` signal in the
worker's main process, whatever the pool. The run is cancelled there, in the
store, so any later delivery of the id, on any worker, restarted or not, is
a duplicate that does not run the body.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_durable.errors import NotJSON
from celery_durable.metrics import jobs as metrics
from celery_durable.store import runs
from celery_durable.store.engine import autocommit, ensure_schema, store_url, unavailable_as_error
from celery_durable.store.json_values import encode
from celery_durable.tasks.execution import call_hook

logger = logging.getLogger("celery_durable.run")


def on_task_revoked(sender: Any = None, request: Any = None, terminated: bool = False, signum: Any = None,
                    expired: bool = False, **_: Any) -> None:
    from celery_durable.tasks.durable import DurableTask

    # ``request`` is the task's Context (Request._announce_revoked sends ``self._context``).
    if not isinstance(sender, DurableTask) or request is None or not getattr(request, "id", None):
        return
    try:
        cancel_revoked(sender, request, reason=_reason(terminated, signum, expired))
    except Exception:
        # A receiver's error is swallowed by Celery's signal dispatch anyway;
        # this names the run. The worker's revoked set still keeps the id out
        # of this worker; a delivery elsewhere would run it.
        logger.exception("durable.run.cancel_failed task=%s id=%s", sender.name, request.id,
                         extra={"event": "durable.run.cancel_failed", "task": sender.name, "run_id": request.id})


def cancel_revoked(task: Any, request: Any, *, reason: str) -> runs.Run | None:
    """Cancel the run of a revoked request; returns it, or None if it had already settled."""
    url = store_url(task.app)
    engine = ensure_schema(url)
    queue = (getattr(request, "delivery_info", None) or {}).get("routing_key")
    with unavailable_as_error(url), autocommit(engine).connect() as conn:
        run = runs.cancel(conn, run_id=request.id, task_name=task.name, queue=queue,
                          args=_json_or_null(getattr(request, "args", None) or []),
                          kwargs=_json_or_null(getattr(request, "kwargs", None) or {}), reason=reason)
    if run is None:
        logger.info("durable.run.revoked_settled task=%s id=%s: already settled, nothing to cancel",
                    task.name, request.id, extra={"event": "durable.run.revoked_settled", "task": task.name,
                                                   "run_id": request.id})
        return None
    logger.info("durable.run.cancelled task=%s id=%s reason=%s", task.name, run.id, reason,
                extra={"event": "durable.run.cancelled", "task": task.name, "run_id": run.id, "reason": reason})
    metrics.count(run.queue, "cancelled")
    call_hook(task, run)
    return run


def _reason(terminated: bool, signum: Any, expired: bool) -> str:
    if expired:
        return "expired"
    if terminated:
        return f"revoked: terminated ({signum})" if signum else "revoked: terminated"
    return "revoked"


def _json_or_null(value: Any) -> str:
    # A cancelled run is never requeued from its row: arguments JSON cannot
    # hold are left out rather than refusing the cancel.
    try:
        return encode("the arguments of a cancelled run", value)
    except NotJSON:
        return "null"
