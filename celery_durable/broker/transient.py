"""Transient messages (``delivery_mode`` 1: Celery's task events and remote control) inserted by a thread of the
process that sent them, in batches.

A row insert on PostgreSQL is a round trip of ~0.3 ms with its NOTIFY, where Redis answers a PUBLISH in
~0.05 ms; a worker with ``-E`` sends three events a task from its event loop, so inserting each there cost
it half its rate while a monitor listened (``benchmarks/PG_BROKER_RESULTS.md``, run J). Sent from here the
loop pays a queue put, and a burst of events is one INSERT.

What a transient message may lose, it loses here as on RabbitMQ: the process that queued it dying before
its batch went (a clean exit flushes first: ``close`` and ``atexit``), or the database refusing the batch
(logged, ``durable.broker.transient_lost``, counted). A forked child sends in its own thread of control,
synchronously: billiard ends a child with ``os._exit``, which runs no ``atexit``.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from queue import Empty, SimpleQueue

from celery_durable.broker.rows import Outgoing

logger = logging.getLogger(__name__)

#: Most messages one INSERT carries.
BATCH = 500

#: Seconds a flush waits for the queued messages to go (at close and at exit).
FLUSH_TIMEOUT = 5.0

_STOP = object()


class TransientSender:
    """A thread that inserts the transient messages one process queued, in order, a batch per statement."""

    def __init__(self, insert: Callable[[Sequence[Outgoing]], None], batch: int = BATCH) -> None:
        self._insert = insert
        self._batch = batch
        self._owner = os.getpid()
        self._queue: SimpleQueue[object] = SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: Messages inserted, and lost to a refused batch, since this sender was made.
        self.sent = 0
        self.lost = 0

    def send(self, messages: Sequence[Outgoing]) -> None:
        if os.getpid() != self._owner:
            self._insert(messages)  # a forked child: no thread of ours there, and no atexit at its end
            return
        self._running()
        for message in messages:
            self._queue.put(message)

    def _running(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._run, name="durable-broker-transient", daemon=True)
            self._thread.start()
            _senders.add(self)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            batch: list[Outgoing] = [item]  # type: ignore[list-item]
            stop = False
            while len(batch) < self._batch:
                try:
                    item = self._queue.get_nowait()
                except Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                batch.append(item)  # type: ignore[arg-type]
            self._send(batch)
            if stop:
                return

    def _send(self, batch: list[Outgoing]) -> None:
        try:
            self._insert(batch)
        except Exception as err:  # noqa: BLE001 - transient messages are dropped on a refusal, and said so
            self.lost += len(batch)
            logger.warning("durable.broker.transient_lost count=%d error=%s", len(batch), err,
                           extra={"event": "durable.broker.transient_lost", "count": len(batch), "error": str(err)})
        else:
            self.sent += len(batch)

    def flush(self, timeout: float = FLUSH_TIMEOUT) -> None:
        """Insert what is queued, then stop the thread (the next send starts one again)."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None or not thread.is_alive():
            return
        self._queue.put(_STOP)
        thread.join(timeout)


#: The senders with a thread running in this process: flushed at exit.
_senders: weakref.WeakSet[TransientSender] = weakref.WeakSet()


@atexit.register
def _flush_all() -> None:
    # A CLI that broadcast a revoke and exits without closing its connection still sends it.
    for sender in list(_senders):
        sender.flush()
