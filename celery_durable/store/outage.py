"""Says once per outage, at warning level, that this process cannot reach a durable store, and when it is back."""

from __future__ import annotations

import logging
import threading

from sqlalchemy.engine import make_url

logger = logging.getLogger("celery_durable.store")

_down: set[str] = set()
_lock = threading.Lock()


def _safe(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def unavailable(url: str, error: BaseException) -> None:
    """Record a failed contact; only the first one of an outage is logged."""
    with _lock:
        if url in _down:
            return
        _down.add(url)
    logger.warning("durable.store.unavailable store=%s: %s; durable runs wait (not acked, no retry spent) "
                   "until it answers", _safe(url), error,
                   extra={"event": "durable.store.unavailable", "store": _safe(url)})


def available(url: str) -> None:
    """Record a successful contact; logs the end of an outage this process had seen."""
    if url not in _down:  # the common case: no lock on the hot path
        return
    with _lock:
        if url not in _down:
            return
        _down.discard(url)
    logger.warning("durable.store.available store=%s: answering again", _safe(url),
                   extra={"event": "durable.store.available", "store": _safe(url)})


def is_down(url: str) -> bool:
    return url in _down
