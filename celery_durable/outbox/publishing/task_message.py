"""Outbox rows' task messages through Celery's own send path: each sent at once, or captured at the transport's edge."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from celery_durable.clock import Clock
from celery_durable.compat.host_types import HostChannel
from celery_durable.compat.kombu_publish import producer_batch_seam_free, producer_publishes_to
from celery_durable.outbox.publishing.sent_events import SentEventEmitter, SentEventRecorder
from celery_durable.store.json_values import from_json
from celery_durable.store.outbox import OutboxRow

#: Kombu's own retry inside one publish: enough to ride over a stale pooled
#: connection after a broker restart, short enough that a down broker fails the
#: pass quickly (the relay's backoff, not kombu's, spaces out the retries).
PUBLISH_RETRY_POLICY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.2}


@dataclass(frozen=True)
class Captured:
    """What kombu's ``Producer`` was about to hand ``channel.basic_publish`` for one row.

    ``message`` is the channel's own ``prepare_message`` result (declarations
    already made); ``publish_kwargs`` are the exact keywords of that call.
    """

    channel: HostChannel
    message: Any
    publish_kwargs: dict[str, Any]
    #: The row's ``task-sent`` event under ``task_send_sent_event``, to emit once the broker has the message.
    sent_event: dict[str, Any] | None = None

    @property
    def exchange(self) -> str:
        return str(self.publish_kwargs.get("exchange") or "")

    @property
    def routing_key(self) -> str:
        return str(self.publish_kwargs.get("routing_key") or "")


class CaptureUnsupported(RuntimeError):
    """The producer offers no seam to capture at (or the send path published more than once)."""


class RowSender:
    """Sends the rows of one batch through one producer the way ``send_task`` would.

    Celery's send_task without its result-backend subscription (a relay must
    not subscribe to every task's result) and without parent inheritance (the
    relay's thread is not the caller's task).
    """

    def __init__(self, app: Any, producer: Any, clock: Clock) -> None:
        self.app = app
        self.producer = producer
        self.clock = clock
        self._send_sent_event = bool(app.conf.task_send_sent_event)
        self._sent_events = SentEventRecorder()
        self._emitter: SentEventEmitter | None = None
        #: Routes whose declarations this batch already made (see ``capture``).
        self._declared: set[tuple[Any, Any]] = set()

    def send(self, row: OutboxRow, *, retry: bool = True, declare: str | None = None) -> None:
        """Publish ``row`` now (the per-message path), with kombu's retry over a stale connection unless told not.

        ``declare="once"``: a route this sender declared before is not declared again (see ``capture``).
        """
        sent_event = self._send(row, retry=retry, declare=declare)
        self._emit([sent_event])

    def announce(self, published: Sequence[Captured]) -> None:
        """Emit the ``task-sent`` events of captured rows the broker now holds (in order)."""
        self._emit([item.sent_event for item in published])

    def capture(self, row: OutboxRow) -> Captured:
        """Run ``row`` through the same path, but keep the prepared message instead of publishing it.

        Everything up to the transport call happens for real: routing, the
        before/after_task_publish signals, queue and exchange declarations,
        serialization, ``prepare_message``. Only ``channel.basic_publish`` is
        left to the caller, which publishes a whole batch at once.
        """
        with _capturing(self.producer) as captured:
            # No kombu retry around a capture: its only broker I/O is a first
            # declaration, and a failure there defers the row like any other.
            sent_event = self._send(row, retry=False, declare="once")
        if len(captured) != 1:
            # One send_task_message publishes one message; anything else is a
            # send path this module does not understand, so it is not batched.
            raise CaptureUnsupported(f"expected one publish for task {row.task_id}, saw {len(captured)}")
        return replace(captured[0], sent_event=sent_event)

    def _emit(self, events: list[dict[str, Any] | None]) -> None:
        if not self._send_sent_event or not any(events):
            return
        if self._emitter is None or self._emitter.producer is not self.producer:
            # A sender kept across pooled producers (publishing/direct.py) emits through the current one.
            self._emitter = SentEventEmitter(self.app, self.producer)
        self._emitter.emit(events)

    def _send(self, row: OutboxRow, *, retry: bool, declare: str | None) -> dict[str, Any] | None:
        """Send (or capture) ``row``'s message; return its ``task-sent`` event, recorded, not yet emitted."""
        amqp = self.app.amqp
        args, kwargs = from_json(row.args), from_json(row.kwargs)
        options: dict[str, Any] = json.loads(row.options)
        # The rest of a chain (frozen at enqueue): the body embed's ``chain``, as chain.apply_async sends it.
        chain = options.pop("chain", None)
        options = amqp.router.route(options, row.task_name, args, kwargs)
        if declare == "once":
            # Celery declares a message's queue on every send, and kombu's
            # declaration cache (keyed on hash(entity) per connection) binds
            # a copy of the queue before it finds it there, a third of a
            # capture's cost. Same rule, kept for the batch: the first row
            # of a route declares as usual; a later one of the same route
            # (same queue entity, same exchange) declares nothing new.
            route = (hash(options.get("queue")), options.get("exchange"))
            if route in self._declared:
                options["declare"] = []
            else:
                self._declared.add(route)
        expires = options.pop("expires", None)
        if expires is not None:
            options["expiration"] = max(0.0, (datetime.fromisoformat(expires) - self.clock.now()).total_seconds())
        # Made at enqueue (or given by the caller); consumed here, not sent as message properties.
        reprs = {"argsrepr": options.pop("argsrepr", None), "kwargsrepr": options.pop("kwargsrepr", None)}
        message = amqp.create_task_message(
            row.task_id, row.task_name, args, kwargs, **reprs,
            eta=options.pop("eta", None), expires=expires,
            reply_to=self.app.thread_oid,
            time_limit=options.pop("time_limit", None),
            soft_time_limit=options.pop("soft_time_limit", None),
            create_sent_event=self._send_sent_event,
            shadow=options.pop("shadow", None),
            chain=chain,
            **options,
        )
        # The event goes to the recorder, not the broker: it is emitted only once the message is there.
        amqp.send_task_message(self.producer, row.task_name, message, retry=retry,
                               retry_policy=PUBLISH_RETRY_POLICY if retry else None,
                               event_dispatcher=self._sent_events, **options)
        return self._sent_events.take()


class _Collector:
    """Sits where kombu keeps an open ``Producer.batch()``: ``Producer._publish`` hands it the prepared message."""

    def __init__(self) -> None:
        self.captured: list[Captured] = []

    def publish(self, channel: HostChannel, message: Any, **publish_kwargs: Any) -> None:
        self.captured.append(Captured(channel, message, publish_kwargs))


@contextmanager
def _capturing(producer: Any) -> Iterator[list[Captured]]:
    if not producer_batch_seam_free(producer):
        raise CaptureUnsupported("the producer has no free publish-batch seam (kombu < 5.7, or a batch is open)")
    collector = _Collector()
    with producer_publishes_to(producer, collector):
        yield collector.captured
