"""RabbitMQ (py-amqp): publish a whole batch on a channel in confirm mode, then wait once for the broker's acks.

Rows count as published only when every message of the batch is acked. A nack,
a channel or connection error, or no acks within ``CONFIRM_TIMEOUT`` fails the
whole batch: its rows stay unpublished and are retried. Messages the broker
took before the failure are then delivered a second time under the same task
ids; the runs table makes a durable task's second delivery a no-op (a plain
Celery task runs again: the outbox is at-least-once).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from celery_durable.clock import Clock
from celery_durable.compat.amqp import publish_unconfirmed
from celery_durable.compat.host_types import AmqpChannel
from celery_durable.compat.kombu_publish import producer_batch_seam_free
from celery_durable.outbox.publishing.outcome import BatchPublished
from celery_durable.outbox.publishing.task_message import Captured, RowSender
from celery_durable.store.outbox import OutboxRow

#: Seconds to wait for the acks of one batch; RabbitMQ confirms hundreds of messages in milliseconds.
CONFIRM_TIMEOUT = 10.0


class ConfirmFailed(RuntimeError):
    """The broker nacked a message of the batch, or did not confirm it in time."""


class ConfirmTimeout(ConfirmFailed):
    """Acks still missing at the deadline."""


def handles(transport: Any, producer: Any) -> bool:
    """py-amqp, on a kombu whose producer lets a batch be captured before the broker (5.7+)."""
    return getattr(transport, "driver_name", None) == "py-amqp" and producer_batch_seam_free(producer)


def publish(app: Any, producer: Any, rows: Sequence[OutboxRow], clock: Clock,
            *, timeout: float = CONFIRM_TIMEOUT) -> BatchPublished:
    sender = RowSender(app, producer, clock)
    captured: list[Captured] = []
    build_error: BaseException | None = None
    for row in rows:
        try:
            captured.append(sender.capture(row))
        except Exception as exc:  # noqa: BLE001 - a row that cannot be built defers the row
            build_error = exc
            break
    if not captured:
        return BatchPublished(0, build_error)
    try:
        publish_confirmed(producer, captured, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - the whole batch failed; its rows are retried
        return BatchPublished(0, exc)
    sender.announce(captured)
    return BatchPublished(len(captured), build_error, batched=len(captured))


def publish_confirmed(producer: Any, captured: Sequence[Captured], *, timeout: float) -> None:
    """Publish ``captured`` in order on a confirm-mode channel; return once the broker acked them all."""
    connection = producer.connection
    # A channel of its own: confirm mode lasts the channel's life, and the
    # pooled producer's channel also serves plain publishes. Opening it is the
    # batch's first broker I/O, so a stale connection (broker restarted) can
    # be replaced here with nothing published yet.
    channel = connection.ensure(producer, _confirm_channel, max_retries=1, interval_start=0,
                                interval_step=0.2, interval_max=0.2)(connection)
    waiter = _AckWaiter(len(captured))
    channel.events["basic_ack"].add(waiter.ack)
    channel.events["basic_nack"].add(waiter.nack)
    healthy = False
    try:
        for item in captured:
            kwargs = item.publish_kwargs
            publish_unconfirmed(channel, item.message, exchange=item.exchange, routing_key=item.routing_key,
                                mandatory=kwargs.get("mandatory", False),
                                immediate=kwargs.get("immediate", False))
        waiter.wait(connection, timeout)
        healthy = True
    except ConfirmTimeout:
        raise
    except ConfirmFailed:
        healthy = True  # a nack: the broker answered, the connection is fine
        raise
    finally:
        _close(connection, channel, healthy)


def _confirm_channel(connection: Any) -> Any:
    channel = connection.channel()
    channel.confirm_select()
    return channel


def _close(connection: Any, channel: AmqpChannel, healthy: bool) -> None:
    if healthy and channel.is_open:
        try:
            channel.close()
            return
        except Exception:  # noqa: BLE001 - fall through: drop the connection instead
            pass
    if not healthy:
        # Frames of this batch may still be in flight (late acks for a channel
        # that is gone): the pool's next user must get a fresh connection.
        connection.collect()


class _AckWaiter:
    """Counts the broker's acks (delivery tags 1..n on a fresh confirm channel, possibly ``multiple``)."""

    def __init__(self, count: int) -> None:
        self.outstanding = set(range(1, count + 1))
        self.nacked: int | None = None

    def ack(self, delivery_tag: int, multiple: bool) -> None:
        if multiple:
            self.outstanding = {tag for tag in self.outstanding if tag > delivery_tag}
        else:
            self.outstanding.discard(delivery_tag)

    def nack(self, delivery_tag: int, multiple: bool) -> None:
        self.nacked = delivery_tag if self.nacked is None else min(self.nacked, delivery_tag)

    def wait(self, connection: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.outstanding and self.nacked is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ConfirmTimeout(f"{len(self.outstanding)} messages not confirmed within {timeout}s")
            try:
                connection.drain_events(timeout=remaining)
            except TimeoutError:
                continue
        if self.nacked is not None:
            raise ConfirmFailed(f"the broker nacked message {self.nacked} of the batch")
