"""Says once per outage, at warning level, that a worker cannot reach a durable store, and when it is back.

Under prefork every pool child meets the outage on its own. While the worker
shares a directory with its children (see ``worker.count_files``), a marker
file there makes the whole worker say it once: the process that creates the
marker logs the outage, the one that removes it logs the recovery. Without a
shared directory (a stock worker, a script) each process says it once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading

from celery_durable.metrics import count_files
from celery_durable.store.urls import shown_url

logger = logging.getLogger("celery_durable.store")

_down: set[str] = set()
_lock = threading.Lock()


def _marker(url: str) -> str | None:
    directory = count_files.shared_dir()
    if directory is None:
        return None
    return str(directory / f"store-outage-{hashlib.sha1(url.encode()).hexdigest()[:16]}")


def _first_to_mark(url: str) -> bool:
    marker = _marker(url)
    if marker is None:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:  # the directory went away (shutdown): say it here rather than not at all
        return True
    return True


def _first_to_unmark(url: str) -> bool:
    marker = _marker(url)
    if marker is None:
        return True
    try:
        os.unlink(marker)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return True


def unavailable(url: str, error: BaseException) -> None:
    """Record a failed contact; only the first one of an outage is logged."""
    with _lock:
        if url in _down:
            return
        _down.add(url)
    if _first_to_mark(url):
        logger.warning("durable.store.unavailable store=%s: %s; durable runs wait (re-sent, no retry spent) "
                       "until it answers", shown_url(url), error,
                       extra={"event": "durable.store.unavailable", "store": shown_url(url)})


def available(url: str) -> None:
    """Record a successful contact; logs the end of an outage this worker had reported."""
    if url not in _down:  # the common case: no lock on the hot path
        return
    with _lock:
        if url not in _down:
            return
        _down.discard(url)
    if _first_to_unmark(url):
        logger.warning("durable.store.available store=%s: answering again", shown_url(url),
                       extra={"event": "durable.store.available", "store": shown_url(url)})


def is_down(url: str) -> bool:
    return url in _down
