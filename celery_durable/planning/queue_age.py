"""Pure: the age of a queue's oldest ready message, from the send time each message carries."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from celery_durable.headers import SENT_AT_HEADER


def oldest_age(heads: Iterable[Mapping[str, Any]], now: float) -> float | None:
    """Seconds since the oldest of ``heads`` (the next message of each priority) was sent.

    None when no head carries a stamp (sent by an app without celery_durable,
    or a broker that does not show its head): an age not known is not 0.
    """
    stamps = []
    for headers in heads:
        try:
            stamps.append(float(headers[SENT_AT_HEADER]))
        except (KeyError, TypeError, ValueError):
            continue
    return max(0.0, now - min(stamps)) if stamps else None


def oldest_ready_seconds(depth: int, heads: Iterable[Mapping[str, Any]], now: float,
                         ready_for: float | None = None) -> float | None:
    """The gauge's value: 0 for an empty queue, else the age the broker itself keeps (``ready_for``: the
    rows broker's), else :func:`oldest_age` of its heads (None: not known)."""
    if depth == 0:
        return 0.0
    return ready_for if ready_for is not None else oldest_age(heads, now)
