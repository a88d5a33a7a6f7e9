"""What the worker reads off Celery's ``Request`` beyond its documented attributes."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from celery.worker.request import Request

from celery_durable.compat.host_types import HostMessage, HostRequest
from celery_durable.headers import ETA_HEADER


def waits_for_eta(request: HostRequest, *, in_pool: bool) -> bool:
    """True once Celery's strategy put the request on the consumer's timer for its ETA/countdown.

    Asked right after the strategy returned. Celery 5.7 records the timer
    entry on the request (``Request._eta_timer_entry``, set in
    ``celery/worker/strategy.py``; None, the class attribute, otherwise). Celery
    5.5 and 5.6 record nothing: there a request with an ``eta`` that the strategy
    did not hand to the pool is on the timer (their strategy times every ETA
    request, a past one included, and executes every other at once).
    """
    if in_pool:
        # The entry is never cleared once it fired: a (past) ETA that fired on the
        # timer thread before the claimer asked has sent the request to the pool.
        return False
    if _RECORDS_ETA_ENTRY:
        return getattr(request, "_eta_timer_entry", None) is not None
    return getattr(request, "eta", None) is not None


_RECORDS_ETA_ENTRY = hasattr(Request, "_eta_timer_entry")


def cached_context(request: object) -> Any:
    """The task ``Context`` the request cached, which ``task_revoked`` is sent with; None if not made yet.

    ``Request._context`` is a ``cached_property`` (celery >= 5.1) stored in the
    instance ``__dict__``; ``Request._announce_revoked`` sends ``request=self._context``.
    """
    return getattr(request, "__dict__", {}).get("_context")


def request_of_callback(callback: Any) -> Any:
    """The ``Request`` a pool's result callback belongs to; None for any other callback.

    ``Request.execute_using_pool`` passes its bound methods ``on_success`` /
    ``on_failure`` as the pool's ``callback``/``error_callback`` (celery 4–5.7).
    """
    return getattr(callback, "__self__", None)


def was_acknowledged(request: HostRequest) -> bool:
    """True once the request's message was acked or rejected through it (``Request.acknowledged``)."""
    return bool(getattr(request, "acknowledged", False))


def skip_ack(request: Any) -> None:
    """Make the request's late ack (or reject) a no-op: its message is no longer this worker's to settle.

    ``Request.acknowledge`` and ``Request.reject`` send nothing once the
    undocumented ``acknowledged`` flag is set (celery 5.x ``worker/request.py``;
    a class attribute, False, checked at boot). Typed ``Any``: the flag is
    not part of ``HostRequest``, whose face is read-only.
    """
    request.acknowledged = True


def eta_ahead(message: HostMessage) -> bool:
    """True if ``message`` (task protocol 2) carries an ETA/countdown still in the future.

    Such a run takes its fleet-limit leases when it falls due, not when it is
    claimed: hours of countdown must not hold a lease.
    """
    eta = (message.headers or {}).get(ETA_HEADER)
    if not eta:
        return False
    try:
        when = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
    except ValueError:
        return False  # Celery's strategy rejects it; nothing to wait for
    if not isinstance(when, datetime):
        return False
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when > datetime.now(timezone.utc)


def acks_late(request: Any) -> bool:
    """Whether ``request``'s task acks its message as the run ends (``Request.task.acks_late``, Celery 5.x)."""
    return bool(request.task.acks_late)
