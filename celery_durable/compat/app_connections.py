"""Forgetting the broker and result backend connections a Celery app has cached.

An app caches its broker connection pool (``app.pool``), its producer pool
(``app.amqp.producer_pool``) and its result backend (per thread, and on Celery
5.7 once for a thread-safe backend) the first time each is used, and never
looks at ``broker_url`` or ``result_backend`` again. The pytest plugin points
one app at a new broker, store and backend for each test: without this, the
second test with another ``broker_url`` sends to the first test's broker.
Celery drops the same pools in ``Celery._after_fork``.
"""

from __future__ import annotations

import threading
from typing import Any


def forget_connections(app: Any) -> None:
    """Drop the app's cached broker pools and result backend: the next use builds them from the conf.

    The pools are dropped, not closed: kombu keeps them in a process-wide
    registry keyed by broker URL (``kombu.pools``), which hands the same pool to
    the next app or test on that URL; closed, it would refuse them.
    """
    app._pool = None
    # app.amqp is a cached_property: dropped, it is built again from the conf, with no producer pool and
    # no queue selection left by an embedded worker's -Q (WorkController selects on the app's own queues).
    app.__dict__.pop("amqp", None)
    if "_backend_cache" in app.__dict__:  # Celery >= 5.7 keeps a thread-safe backend here
        app._backend_cache = None
    # The per-thread backend (and the thread's oid, which a new rpc:// backend's reply queue is named by).
    app._local = threading.local()
