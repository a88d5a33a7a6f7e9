"""What boot reads and writes on Celery's ``WorkController`` at ``worker_init``: its pool, consumer and size.

Celery sets ``pool_cls``, ``consumer_cls`` and ``concurrency`` on the worker in
``WorkController.setup_defaults`` (from -P, ``worker_consumer`` and -c) and
reads them only afterwards, when its bootsteps build the pool and the
consumer (celery 5.x ``worker/worker.py``, ``worker/components.py``): a
``worker_init`` receiver that changes them picks the pool, consumer and pool
size the worker is built with. None is documented; they are instance
attributes, so boot checks the live worker (``missing_on``) before touching them.
"""

from __future__ import annotations

from typing import Any

from celery_durable.errors import HostIncompatible

#: The WorkController attributes boot reads and sets.
WORKER_ATTRIBUTES = ("pool_cls", "consumer_cls", "concurrency")


def missing_on(worker: Any) -> list[str]:
    """The attributes of ``WORKER_ATTRIBUTES`` the live worker lacks."""
    return [name for name in WORKER_ATTRIBUTES if not hasattr(worker, name)]


def check_worker(worker: Any) -> None:
    """Refuse (HostIncompatible, one line) if the worker lacks an attribute boot sets."""
    absent = missing_on(worker)
    if absent:
        names = ", ".join(f"celery.worker.WorkController.{name}" for name in absent)
        raise HostIncompatible(f"the installed Celery's worker lacks {names}, which -P durable sets at "
                               f"worker_init (celery_durable.compat.worker_controller)")


def pool_of(worker: Any) -> Any:
    """The pool the worker will build: -P as given (a name or a path) or, once resolved, a class."""
    return worker.pool_cls


def use_pool(worker: Any, path: str) -> None:
    """Build the worker's pool from ``path`` (``module:Class``) instead."""
    worker.pool_cls = path


def use_consumer(worker: Any, path: str) -> None:
    """Build the worker's consumer from ``path`` (``module:Class``) instead."""
    worker.consumer_cls = path


def pool_size(worker: Any) -> int:
    """The pool size the worker will start with (-c, ``worker_concurrency``, or Celery's CPU count)."""
    return int(worker.concurrency)


def size_pool(worker: Any, size: int) -> None:
    """Start the worker's pool with ``size`` processes or threads."""
    worker.concurrency = size
