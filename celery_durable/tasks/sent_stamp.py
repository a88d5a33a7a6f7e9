"""Stamp each task message with the time it is sent, for the queue gauges' oldest-ready age.

Neither Redis nor RabbitMQ keeps a message's enqueue time where a reader can
see it, and Celery's own headers carry none. Stamped on every send (a retry
and a re-send are ready again from then), by ``before_task_publish``, which
runs for ``apply_async``, ``send_task``, canvas and the outbox relay alike.
"""

from __future__ import annotations

from time import time
from typing import Any

from celery_durable.headers import SENT_AT_HEADER


def stamp(headers: dict[str, Any] | None = None, **_: Any) -> None:
    if headers is not None:
        headers[SENT_AT_HEADER] = time()
