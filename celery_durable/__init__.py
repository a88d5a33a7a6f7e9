"""celery_durable: a Celery worker that claims instead of prefetching, and the parts around it."""

from __future__ import annotations

from typing import Any

from .config import DurableConfig, from_celery_conf
from .errors import ConfigInvalid, DurableError, InvariantBroken
from .worker.boot import register as _register_pool

__all__ = [
    "ConfigInvalid",
    "DurableConfig",
    "DurableError",
    "InvariantBroken",
    "from_celery_conf",
    "install",
]

__version__ = "0.1.0"

# Registering the pool alias is the one side effect of import: it lets
# ``celery -A proj worker -P durable`` resolve for an app that imports us.
_register_pool()


def install(app: Any) -> Any:
    """Install celery_durable on a Celery app; returns the app.

    Registers ``-P durable`` (also usable as ``app.conf.worker_pool =
    "durable"``). Settings are read and validated when a worker boots.
    """
    _register_pool()
    return app
