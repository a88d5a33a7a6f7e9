"""Registering ``-P durable`` in Celery's pool table and in the worker command's ``-P`` choices."""

from __future__ import annotations

import logging
import sys

from celery import concurrency

logger = logging.getLogger(__name__)


def register_pool_alias(alias: str, path: str) -> None:
    """Make ``-P alias`` and ``worker_pool = alias`` resolve to ``path``.

    Relies on ``celery.concurrency.ALIASES`` (a module dict, undocumented but
    read by ``get_implementation`` in every 5.x) and on ``celery.bin.worker.WORKERS_POOL``,
    the click ``Choice`` whose ``choices`` Celery freezes at import of its worker
    command (celery >= 5.0): the alias is appended there when that module is loaded.
    """
    current = concurrency.ALIASES.get(alias)
    if current not in (None, path):
        logger.warning("durable.boot.alias_conflict: pool alias %r was %r; replacing it", alias, current,
                       extra={"event": "durable.boot.alias_conflict", "alias": alias, "was": current})
    concurrency.ALIASES[alias] = path
    worker_cli = sys.modules.get("celery.bin.worker")
    if worker_cli is not None:
        choices = tuple(worker_cli.WORKERS_POOL.choices)
        if alias not in choices:
            worker_cli.WORKERS_POOL.choices = (*choices, alias)
