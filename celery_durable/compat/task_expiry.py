"""Keep a task's expiry in its ``expires`` header, out of RabbitMQ's per-message TTL.

``Celery.send_task`` turns ``expires`` into both the ``expires`` header (the
worker marks a task received after it REVOKED) and kombu's ``expiration``
property (RabbitMQ drops the message, unseen, once it has waited that long).
Stock Celery's prefetch takes messages off the queue before they expire, so
its workers see them and mark them REVOKED. A ``-P durable`` worker buffers
nothing: an expired message waits in the queue for a free slot, and RabbitMQ
drops it first, leaving its result PENDING forever.

Relies on Celery's ``send_task_message`` (5.x) handing ``before_task_publish``
the very ``properties`` dict it then publishes with (pinned by
tests/compat/test_task_expiry.py). Only a TTL that Celery derived from
``expires`` goes: a message without an ``expires`` header keeps an
``expiration`` the caller set himself.
"""

from __future__ import annotations

from typing import Any

#: The kombu publish property Celery sets from ``expires`` (milliseconds as a string, for RabbitMQ).
TTL_PROPERTY = "expiration"


def keep_expiry_in_headers(headers: dict[str, Any] | None = None, properties: dict[str, Any] | None = None,
                           **_: Any) -> None:
    """``before_task_publish`` receiver: drop the broker TTL of a message whose ``expires`` header says it all."""
    if properties is not None and headers is not None and headers.get("expires") is not None:
        properties.pop(TTL_PROPERTY, None)
