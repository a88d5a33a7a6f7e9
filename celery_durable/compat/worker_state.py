"""Whether the worker was asked to shut down, read from Celery's worker state.

Relies on ``celery.worker.state.should_stop`` and ``should_terminate``:
undocumented module globals (present throughout Celery 5.x) that the
worker's signal handlers set to an exit code, which may be 0, and that are
None until then; and on ``maybe_shutdown``, which raises the matching
``WorkerShutdown``/``WorkerTerminate`` once they are set.
"""

from __future__ import annotations

from celery.worker import state as _state


def shutdown_requested() -> bool:
    """True once a warm or cold shutdown of this worker was requested."""
    return _state.should_stop is not None or _state.should_terminate is not None


def raise_if_shutdown_requested() -> None:
    """Raise Celery's own shutdown exception if one was requested (``state.maybe_shutdown``)."""
    _state.maybe_shutdown()
