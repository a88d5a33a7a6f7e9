"""What the worker reads off Celery's ``Request`` beyond its documented attributes."""

from __future__ import annotations

from typing import Any


def waits_for_eta(request: Any) -> bool:
    """True once Celery's consumer put the request on its timer for its ETA/countdown.

    ``Request._eta_timer_entry`` is set by ``Consumer.apply_eta_task``'s timer
    call (celery >= 5.3, ``celery/worker/consumer/consumer.py``) and is None
    (the class attribute) otherwise.
    """
    return getattr(request, "_eta_timer_entry", None) is not None


def cached_context(request: Any) -> Any:
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
