"""celery_durable: a Celery worker that claims instead of prefetching, and the parts around it."""

from __future__ import annotations

import functools
from typing import Any

from celery_durable import outbox
from celery_durable.broker import register as _register_broker
from celery_durable.config import DurableConfig, from_celery_conf
from celery_durable.errors import (
    BeatEntryInvalid,
    ConfigInvalid,
    DurableError,
    InvariantBroken,
    NotDurable,
    NotJSON,
    OutboxDatabaseMismatch,
    OutboxInvalid,
    RunNotDead,
    RunNotFound,
    RunSettled,
    SchemaOutdated,
    StepNameInvalid,
    StoreUnavailable,
    TransactionEnded,
    TransactionUnsupported,
)
from celery_durable.outbox.transaction import transaction
from celery_durable.tasks import runs
from celery_durable.tasks.context import sleep, step
from celery_durable.tasks.durable import DurableTask, durable_task
from celery_durable.worker.boot import register as _register_pool
from celery_durable.worker.cli_options import add_worker_options
from celery_durable.worker.signals import connect_install

__all__ = [
    "BeatEntryInvalid",
    "ConfigInvalid",
    "DurableConfig",
    "DurableError",
    "DurableTask",
    "InvariantBroken",
    "NotDurable",
    "NotJSON",
    "OutboxDatabaseMismatch",
    "OutboxInvalid",
    "RunNotDead",
    "RunNotFound",
    "RunSettled",
    "Scheduler",
    "SchemaOutdated",
    "StepNameInvalid",
    "StoreUnavailable",
    "TransactionEnded",
    "TransactionUnsupported",
    "from_celery_conf",
    "install",
    "outbox",
    "runs",
    "sleep",
    "step",
    "transaction",
]

__version__ = "0.1.0"

# Registering the pool alias is the one side effect of import: it lets
# ``celery -A proj worker -P durable`` resolve for an app that imports us.
_register_pool()


def install(app: Any) -> Any:
    """Install celery_durable on a Celery app; returns the app. Calling it again changes nothing.

    Registers ``-P durable`` (also usable as ``app.conf.worker_pool =
    "durable"``), adds ``app.durable_task``, adds the worker options
    (``--max-in-flight``, ``--queue-concurrency``, ``--drain-timeout``,
    ``--metrics-port``), makes a revoke of a durable task cancel its run
    (any pool), registers the ``durable+postgresql://`` broker URL (docs/pg-broker.md), stamps
    each task message sent with its send time (the ``durable_sent_at`` header the queue gauges
    read) and keeps its ``expires`` in its headers only, not as RabbitMQ's per-message TTL (an
    expired task ends REVOKED; docs/worker.md). Settings are read and validated when a worker
    boots; the durable store is opened on a durable task's first run.
    """
    _register_pool()
    _register_broker()
    connect_install()
    add_worker_options(app)
    if not isinstance(getattr(app, "durable_task", None), functools.partial):
        app.durable_task = functools.partial(durable_task, app)
    return app


def __getattr__(name: str) -> Any:
    # ``celery beat -S celery_durable.Scheduler``: imported when asked for, so a worker or a
    # publisher never loads celery.beat.
    if name == "Scheduler":
        from celery_durable.beat.scheduler import Scheduler

        return Scheduler
    raise AttributeError(f"module 'celery_durable' has no attribute {name!r}")

