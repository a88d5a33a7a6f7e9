"""What the ``-P durable`` pools (``prefork.py``, ``threads.py``) add to Celery's: each finished run is reported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from celery_durable.compat.host_types import HostRequest
from celery_durable.compat.request import request_of_callback
from celery_durable.worker.task_outcomes import settling


class RunListener(Protocol):
    """What the pool tells about a run the consumer handed it."""

    def run_pooled(self, request: HostRequest) -> None: ...

    def run_finished(self, request: HostRequest) -> None: ...

    def is_handed_back(self, request: HostRequest) -> bool: ...


class DurablePoolMixin:
    """Wraps the pool's result callbacks so a finish frees its slot at once.

    The callbacks are the request's ``on_success``/``on_failure``; they fire in
    the worker process for prefork (the hub thread, or the result thread
    without an event loop) and threads (the executor thread) alike, after
    Celery has acked and marked the request ready.
    """

    #: Set by the durable consumer once it exists (the pool is built first).
    run_listener: RunListener | None = None

    def apply_async(self, target: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        listener = self.run_listener
        callback = options.get("callback")
        request = request_of_callback(callback)
        if listener is not None and request is not None:
            options["callback"] = _then_release(callback, listener, request)
            options["error_callback"] = _then_release(options.get("error_callback"), listener, request)
            if options.get("timeout_callback") is not None:
                options["timeout_callback"] = _settling(options["timeout_callback"], request)
            # From here the callbacks above give the count back (a terminate
            # revoke included): the revoke signal must not give it back too.
            listener.run_pooled(request)
        return super().apply_async(target, args, kwargs, **options)  # type: ignore[misc]

    def on_stop(self) -> None:
        # The drain's deadline runs beside Celery's join of the pool.
        drain = getattr(self, "drain", None)
        if drain is not None:
            drain.start()
        super().on_stop()  # type: ignore[misc]


def _then_release(
    callback: Callable[..., Any] | None, listener: RunListener, request: HostRequest
) -> Callable[..., Any]:
    def finished(*args: Any, **kwargs: Any) -> None:
        try:
            # A run handed back at the drain deadline is the broker's again:
            # its late failure (the child was killed) must not ack it or mark
            # the task failed.
            if callback is not None and not listener.is_handed_back(request):
                with settling(request):
                    callback(*args, **kwargs)
        finally:
            listener.run_finished(request)

    return finished


def _settling(callback: Callable[..., Any], request: HostRequest) -> Callable[..., Any]:
    """A hard time limit's callback: a task_failure it sends is about ``request`` (``task_outcomes``)."""
    def timed_out(*args: Any, **kwargs: Any) -> Any:
        with settling(request):
            return callback(*args, **kwargs)

    return timed_out
