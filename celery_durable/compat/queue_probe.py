"""What a broker says about a queue without running anything from it: its ready messages and the next one's headers.

The queue gauges (``metrics/queues.py``) read it at scrape time, one round trip per queue:

- Redis: ``LLEN`` and ``LINDEX -1`` (the tail, where kombu pops) of each of the queue's priority
  lists, in one pipeline. Nothing is taken.
- RabbitMQ: a ``basic.get`` (its ``GetOk`` counts the messages left) and a ``basic.reject`` with
  requeue, which puts the message back in its place. RabbitMQ marks it redelivered; Celery reads that
  flag only under ``worker_deduplicate_successful_tasks`` (one result-backend lookup for that run). A
  quorum queue counts deliveries against its ``delivery-limit``: there only the depth is read
  (a passive declare), not the head.
- The broker that claims rows (``durable+``): one query of the queue's ready rows, their count and
  how long the oldest has been ready, in the database's clock (no header needed).
- kombu's other virtual transports (the SQLAlchemy broker): a passive declare's message count; the
  head is not read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kombu.utils.encoding import bytes_to_str

from celery_durable.compat.redis_claim import prefixed_priority_lists, unprefixed


@dataclass(frozen=True)
class QueueProbe:
    """One queue as the broker holds it now."""

    #: Messages ready to be delivered (not those a worker holds unacked).
    depth: int
    #: The headers of the oldest ready message of each priority (the next to go), as far as the broker lets
    #: them be read without taking them; empty when the queue is empty or its head cannot be read.
    heads: tuple[dict[str, Any], ...] = ()
    #: Seconds the oldest ready message has been ready, where the broker keeps it (the rows broker).
    ready_for: float | None = None


def probe(channel: Any, queue: Any) -> QueueProbe | None:
    """``queue`` (a kombu ``Queue``) on ``channel``; None when the broker has no such queue."""
    driver = channel.connection.client.transport.driver_type
    if driver == "redis":
        return _redis(channel, queue.name)
    if driver == "amqp":
        if (queue.queue_arguments or {}).get("x-queue-type") in ("quorum", "stream"):
            return _declared_depth(channel, queue.name)
        return _amqp(channel, queue.name)
    if driver == "durable":
        depth, ready_for = channel.rows.readiness(queue.name)
        return QueueProbe(depth, ready_for=ready_for)
    return _declared_depth(channel, queue.name)


def _redis(channel: Any, name: str) -> QueueProbe:
    lists = prefixed_priority_lists(channel, name)
    with channel.conn_or_acquire() as client:
        pipe = unprefixed(client).pipeline(transaction=False)
        for key in lists:
            pipe.llen(key)
            pipe.lindex(key, -1)
        replies = pipe.execute()
    depth = sum(int(length) for length in replies[0::2])
    heads = tuple(headers for headers in (_item_headers(item) for item in replies[1::2] if item is not None)
                  if headers is not None)
    return QueueProbe(depth, heads)


def _item_headers(item: Any) -> dict[str, Any] | None:
    """The headers of a kombu Redis item (``{"body": ..., "headers": {...}, ...}``); None if it is not one."""
    try:
        headers = json.loads(bytes_to_str(item)).get("headers")
    except (ValueError, AttributeError):
        return None  # poison: the claim parks it; it has no age to give
    return headers if isinstance(headers, dict) else None


def _amqp(channel: Any, name: str) -> QueueProbe | None:
    from amqp.exceptions import NotFound

    try:
        message = channel.basic_get(queue=name, no_ack=False)
    except NotFound:
        return None
    if message is None:
        return QueueProbe(0)
    # Back in its place before anything else is done with it.
    channel.basic_reject(message.delivery_tag, requeue=True)
    left = int(message.delivery_info.get("message_count") or 0)
    headers = message.properties.get("application_headers") or {}
    return QueueProbe(left + 1, (dict(headers),))


def _declared_depth(channel: Any, name: str) -> QueueProbe | None:
    try:
        declared = channel.queue_declare(queue=name, passive=True)
    except channel.connection.client.channel_errors:
        return None
    return QueueProbe(int(declared.message_count))
