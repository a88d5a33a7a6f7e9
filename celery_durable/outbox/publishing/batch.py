"""Publish a claimed outbox batch: pick the way the producer's transport allows, report how far it got."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_durable.clock import Clock
from celery_durable.outbox.publishing.outcome import BatchPublished
from celery_durable.outbox.publishing.task_message import RowSender
from celery_durable.store.outbox import OutboxRow


def publish_batch(app: Any, producer: Any, rows: Sequence[OutboxRow], clock: Clock) -> BatchPublished:
    """Publish ``rows`` through ``producer``: Redis in one MULTI/EXEC, RabbitMQ under publisher confirms.

    Other transports (the SQLAlchemy and memory ones among them) publish one
    message at a time, as ``apply_async`` would.
    """
    published = _publish(app, producer, rows, clock)
    if published.sent == 0 and _lost_connection(producer, published.error) and _reconnect(producer):
        # A pooled connection the broker dropped (a broker restart, an operator
        # closing connections) fails on its first use. Kombu's own publish
        # retries once over a fresh connection; so does a batch, now rather
        # than after the relay's backoff. Whatever a failed batch left on the
        # broker goes out again under the same task ids either way.
        published = _publish(app, producer, rows, clock)
    return published


def _publish(app: Any, producer: Any, rows: Sequence[OutboxRow], clock: Clock) -> BatchPublished:
    from celery_durable.outbox.publishing import amqp_confirms, redis_pipeline

    transport = producer.connection.transport
    if redis_pipeline.handles(transport, producer):
        return redis_pipeline.publish(app, producer, rows, clock)
    if amqp_confirms.handles(transport, producer):
        return amqp_confirms.publish(app, producer, rows, clock)
    return publish_one_by_one(app, producer, rows, clock)


def publish_one_by_one(app: Any, producer: Any, rows: Sequence[OutboxRow], clock: Clock) -> BatchPublished:
    """Kombu's per-message path, in id order, stopping at the first failure."""
    sender = RowSender(app, producer, clock)
    for index, row in enumerate(rows):
        try:
            sender.send(row)
        except Exception as exc:  # noqa: BLE001 - any publish failure defers the row
            return BatchPublished(sent=index, error=exc, one_by_one=index)
    return BatchPublished(sent=len(rows), one_by_one=len(rows))


def _lost_connection(producer: Any, error: BaseException | None) -> bool:
    return error is not None and isinstance(error, producer.connection.recoverable_connection_errors)


def _reconnect(producer: Any) -> bool:
    """Replace the producer's connection and channel; False if the broker cannot be reached now."""
    connection = producer.connection
    connection.collect()
    try:
        connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0.2, interval_max=0.2)
        producer.revive(connection.default_channel)
    except Exception:  # noqa: BLE001 - the broker is down: the relay's backoff takes it from here
        return False
    return True
