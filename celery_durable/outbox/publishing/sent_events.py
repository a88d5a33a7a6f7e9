"""The ``task-sent`` events of outbox rows: recorded while a row's message is built, emitted once the broker has it.

Under ``task_send_sent_event`` Celery's ``send_task_message`` publishes the
event right after the message, through the same producer. A relay builds a
batch's messages before any reaches the broker (and a batch can fail as a
whole), so the event is recorded instead of published, and emitted for a row
only after the broker took that row's message: Flower and ``celery events``
see each task sent when it was, and never one that a failed batch left behind.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)

#: The event ``send_task_message`` emits; the only one it publishes.
TASK_SENT = "task-sent"


class SentEventRecorder:
    """Stands where ``send_task_message`` takes its ``event_dispatcher``: keeps the event instead of publishing it."""

    def __init__(self) -> None:
        self.recorded: dict[str, Any] | None = None

    def publish(self, kind: str, fields: dict[str, Any], producer: Any, **_: Any) -> None:
        if kind != TASK_SENT:
            # Celery publishes no other event here; a new one is a send path this module does not know.
            raise ValueError(f"send_task_message published an unexpected event {kind!r}")
        self.recorded = dict(fields)

    def take(self) -> dict[str, Any] | None:
        recorded, self.recorded = self.recorded, None
        return recorded


class SentEventEmitter:
    """Publishes recorded ``task-sent`` events through the relay's producer, as Celery's own dispatcher would."""

    def __init__(self, app: Any, producer: Any) -> None:
        self.producer = producer
        # Disabled and not buffering: it only shapes and publishes through the producer handed to it
        # (as Celery's own send path uses one), and a failed publish raises here instead of
        # waiting in a buffer nobody flushes.
        self.dispatcher = app.events.Dispatcher(connection=producer.connection, enabled=False,
                                                buffer_while_offline=False)

    def emit(self, events: Iterable[dict[str, Any] | None]) -> None:
        """Publish each event; a failure is logged, never raised: the rows' messages are already on the broker."""
        for fields in events:
            if fields is None:
                continue
            try:
                self.dispatcher.publish(TASK_SENT, fields, self.producer, retry=True,
                                        retry_policy={"max_retries": 1, "interval_start": 0})
            except Exception as exc:  # noqa: BLE001 - a monitoring event must not republish a sent task
                logger.warning("durable.outbox.sent_event_failed task_id=%s error=%s", fields.get("uuid"), exc,
                               extra={"event": "durable.outbox.sent_event_failed", "task_id": fields.get("uuid"),
                                      "error": repr(exc)})
