"""How each task a ``-P durable`` worker runs ended, read off Celery's task signals into ``metrics.tasks``.

Connected at a durable worker's boot (``worker/signals.py``), before the pool
forks, so its children have the receivers too. Where Celery sends each signal:

- ``task_success`` (with the trace's runtime), ``task_retry`` and
  ``task_failure`` for an exception the task raised: in the process that ran
  it (the pool child; the executor thread under threads), the task's
  request on its stack.
- ``task_revoked``: in the worker process, for a revoke or an expiry before
  the task started and for a terminate while it ran.
- ``task_failure`` for a hard time limit or a lost pool child: in the worker
  process, from the pool's callbacks for the request. Celery 5.7 sends it
  there twice for a hard time limit (the job's error callback and the
  timeout callback): it is counted once per request.

Eager calls (``task.apply()``) are not counted: no worker delivered them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.compat.host_types import HostRequest
from celery_durable.metrics import tasks as metrics
from celery_durable.planning.task_series import Labels

_local = threading.local()
#: Ids of tasks whose failure the worker process counted, so a second signal for one is not counted again.
_failed_here: OrderedDict[str, None] = OrderedDict()
_FAILED_REMEMBERED = 10_000
_failed_lock = threading.Lock()


@contextmanager
def settling(request: HostRequest) -> Iterator[None]:
    """The pool calls a request's result or timeout callback inside this: its signals are the worker process's."""
    previous = getattr(_local, "settling", None)
    _local.settling = request
    try:
        yield
    finally:
        _local.settling = previous


def on_prerun(sender: Any = None, task_id: Any = None, **_: Any) -> None:
    # Celery before 5.7 sends task_success without the runtime: measured from here instead (connected
    # only there, ``worker/signals.py``).
    _local.started = (task_id, SYSTEM_CLOCK.monotonic())


def on_success(sender: Any = None, runtime: Any = None, **_: Any) -> None:
    request = getattr(sender, "request", None)
    labels = _traced(sender, request)
    if labels is None or request is None:
        return
    if not isinstance(runtime, (int, float)):
        started = getattr(_local, "started", None)
        runtime = SYSTEM_CLOCK.monotonic() - started[1] if started and started[0] == request.id else 0.0
    metrics.succeeded(labels, float(runtime))


def on_retry(sender: Any = None, request: Any = None, **_: Any) -> None:
    labels = _traced(sender, request)
    if labels is not None:
        metrics.count("retried", labels)


def on_failure(sender: Any = None, task_id: Any = None, exception: Any = None, **_: Any) -> None:
    exception_name = type(exception).__name__ if exception is not None else ""
    settling_request = getattr(_local, "settling", None)
    if settling_request is not None and getattr(settling_request, "id", None) == task_id:
        if _counted_before(str(task_id)):
            return
        metrics.count("failed", _labels(settling_request.name, settling_request), exception=exception_name)
        return
    labels = _traced(sender, getattr(sender, "request", None))
    if labels is not None:
        metrics.count("failed", labels, exception=exception_name)


def on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    if request is None:
        return
    name = getattr(sender, "name", None) or getattr(request, "task", None) or ""
    metrics.count("revoked", _labels(str(name), request))


def _traced(sender: Any, request: Any) -> Labels | None:
    """The labels of the task the signal is about, or None for a call no worker delivered."""
    if sender is None or request is None or getattr(request, "id", None) is None:
        return None
    if getattr(request, "is_eager", False):
        return None
    return _labels(str(getattr(sender, "name", "") or ""), request)


def _labels(name: str, request: Any) -> Labels:
    delivery = getattr(request, "delivery_info", None) or {}
    return (name, str(getattr(request, "hostname", None) or ""), str(delivery.get("routing_key") or ""))


def _counted_before(task_id: str) -> bool:
    with _failed_lock:
        if task_id in _failed_here:
            return True
        _failed_here[task_id] = None
        if len(_failed_here) > _FAILED_REMEMBERED:
            _failed_here.popitem(last=False)
        return False
