"""``-P durable``'s prefork execution (the default): Celery's prefork pool reporting each finished run.

The module is named ``prefork`` on purpose: Celery's embedded test worker
(``celery.contrib.testing.worker.start_worker``) forwards the pool children's
log records to the test process (``caplog``) only when the pool class lives in
a module whose last name is ``prefork``.
"""

from __future__ import annotations

from celery.concurrency.prefork import TaskPool as PreforkTaskPool

from celery_durable.compat.asynpool import ReapingAsynPool
from celery_durable.worker.pool import DurablePoolMixin


class DurablePool(DurablePoolMixin, PreforkTaskPool):
    """Prefork execution (the default of ``-P durable``)."""

    # With an event loop: a recycled child is replaced as soon as it exits,
    # not at Celery's next 5 s pool check (see child_reaping).
    Pool = ReapingAsynPool
