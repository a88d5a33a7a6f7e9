"""Listens to Celery's events on a real broker, as Flower and ``celery events`` do, and keeps what it heard."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery

#: The event type a probe sends to learn that the receiver's queue is bound (a fanout on Redis drops
#: what is published before its subscriber is listening).
PROBE = "task-sent"


class EventLog:
    """Every event the receiver heard, in arrival order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []

    def add(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(dict(event))

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self._events if e.get("type") == kind]

    def task_sent(self, task_id: str) -> list[dict[str, Any]]:
        """The ``task-sent`` events for ``task_id``."""
        return [e for e in self.of_type("task-sent") if e.get("uuid") == task_id]


@contextmanager
def listening(broker_url: str, *, ready_within: float = 15.0) -> Iterator[EventLog]:
    """Receive every event on ``broker_url`` while open; returns once a probe event has come through."""
    app = Celery(f"event-listener-{uuid.uuid4().hex[:6]}", broker=broker_url)
    app.conf.broker_connection_retry_on_startup = True
    log = EventLog()
    connection = app.connection_for_read()
    receiver = app.events.Receiver(connection, handlers={"*": log.add})
    thread = threading.Thread(target=receiver.capture, kwargs={"limit": None, "timeout": None, "wakeup": False},
                              name="event-listener", daemon=True)
    thread.start()
    probe = f"probe-{uuid.uuid4().hex}"
    try:
        with app.connection_for_write() as conn:
            dispatcher = app.events.Dispatcher(conn, enabled=True, buffer_while_offline=False)
            deadline = time.monotonic() + ready_within
            while not log.task_sent(probe):
                if time.monotonic() > deadline or not thread.is_alive():
                    raise AssertionError(f"the event receiver on {broker_url} heard no probe in {ready_within}s")
                dispatcher.send(PROBE, uuid=probe)
                time.sleep(0.1)
            dispatcher.close()
        yield log
    finally:
        receiver.should_stop = True
        thread.join(timeout=5)
        connection.release()
        app.close()
