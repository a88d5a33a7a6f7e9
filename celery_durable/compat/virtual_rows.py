"""kombu's virtual transport over a table of rows: the private hooks of ``kombu.transport.virtual`` mapped
onto a plain ``RowBackend`` (the PostgreSQL broker's rows), so the broker itself touches no kombu internal.

The hooks a virtual channel must fill are private names of kombu 5.x
(``Channel._get``/``_put``/``_size``/``_purge``/``_delete``/``_new_queue``/``_has_queue``,
``_restore``/``_restore_at_beginning``, ``_get_message_priority``, ``_inplace_augment_message``,
``Transport._deliver``/``_callbacks``/``_active_queues``); tests/compat/test_virtual_rows.py pins them.
What changes from kombu's in-memory contract: an unacked message is a leased row, so giving one back
(``reject(requeue=True)``, ``restore_unacked`` at close, ``basic_recover``) clears its holder in
place instead of publishing a copy at the tail, and ``drain_events`` waits on the backend's wake-up
(LISTEN/NOTIFY) instead of sleeping a polling interval. In Celery's event loop (a worker with a hub)
the transport is evented as kombu's Redis transport is: ``register_with_event_loop`` puts the
backend's wake-up file descriptors (the LISTEN socket, a self-pipe) in the hub, and ``on_wakeup``
claims for the consumers of the queues a NOTIFY named.

Exchanges across processes are ``compat/row_exchanges.py``'s. A queue consumed without acks (Celery's
pidbox and reply queues, an event receiver) has its rows claimed and deleted in one go (``take``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from queue import Empty
from typing import Any, Protocol

from kombu.transport import virtual

from celery_durable.compat.row_exchanges import ExchangeChannel, SharedBindings
from celery_durable.headers import ETA_HEADER

#: Rows a channel with no prefetch limit takes in one claim.
UNLIMITED_BATCH = 100

#: Claims one wake-up may make for a transport's consumers before the event loop serves its other readers.
MAX_CLAIMS_PER_WAKE = 8

#: The header naming a delivery delay in milliseconds (the convention of RabbitMQ's delayed-message exchange).
DELAY_HEADER = "x-delay"

#: Seconds between two refreshes of the bindings of the expiring queues a connection consumes (the
#: shortest ``x-expires`` Celery declares is its control queues' 10 s).
BINDINGS_REFRESH_INTERVAL = 2.0


class RowBackend(SharedBindings, Protocol):
    """Messages as rows under leases; tags are the backend's own (a row id)."""

    def publish(self, items: Sequence[tuple[str, dict[str, Any], int, float]]) -> None:
        """Insert (queue, message, priority, delay seconds) items, all in one statement."""

    def claim(self, queue: str, limit: int) -> list[dict[str, Any]]:
        """Take up to ``limit`` ready messages of ``queue`` under a lease; each carries its delivery tag."""

    def take(self, queue: str, limit: int) -> list[dict[str, Any]]:
        """Claim up to ``limit`` messages of ``queue`` and delete them at once (a consumer without acks)."""

    def ack(self, tag: Any) -> None: ...

    def give_back(self, tag: Any) -> None:
        """Make a held message ready again in its own place."""

    def readiness(self, queue: str) -> tuple[int, float | None]:
        """(ready messages of ``queue``, seconds the oldest has been ready, None if none is)."""

    def ping(self) -> None:
        """Reach the store now, raising the transport's connection error if it cannot be reached."""

    def clear_wakeups(self) -> None: ...

    def wait(self, timeout: float) -> bool:
        """Block until a message may have arrived, ``wake()`` is called or ``timeout`` seconds pass."""

    def wake(self) -> None:
        """End a ``wait`` now, from any thread."""

    def wakeup_fds(self) -> list[int]:
        """The file descriptors that turn readable on a wake-up (for an event loop to poll)."""

    def take_wakeups(self) -> tuple[bool, set[str]]:
        """Forget the wake-ups seen so far: (woken by ``wake()``, the queues a NOTIFY named)."""

    def close(self) -> None: ...


def delivery_delay(headers: Mapping[str, Any], now: float) -> float:
    """Seconds until a message may be handed out: its ``x-delay``, or the time left to Celery's ``eta``
    (a countdown or ETA of task protocol 2: an ISO 8601 time, UTC when it names no zone, as Celery's
    default ``enable_utc``), whichever is later; 0 for a message due now or a time that does not parse."""
    delay = 0.0
    try:
        delay = float(headers.get(DELAY_HEADER) or 0) / 1000.0
    except (TypeError, ValueError):
        pass
    eta = headers.get(ETA_HEADER)
    if isinstance(eta, str) and eta:
        try:
            at = datetime.fromisoformat(eta)
        except ValueError:
            return max(delay, 0.0)
        if at.tzinfo is None:
            at = at.replace(tzinfo=timezone.utc)
        delay = max(delay, at.timestamp() - now)
    return max(delay, 0.0)


class RowChannel(ExchangeChannel):
    """A virtual channel whose queues are the backend's rows (its exchanges: ``compat/row_exchanges.py``)."""

    def __init__(self, connection: Any, **kwargs: Any) -> None:
        #: Queues consumed without acks here: a row claimed for them is deleted as it is delivered.
        self._no_ack: set[str] = set()
        super().__init__(connection, **kwargs)

    @property
    def rows(self) -> RowBackend:
        rows: RowBackend = self.connection.rows
        return rows

    # -- consuming without acks ----------------------------------------------------------------------------
    def basic_consume(self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any) -> Any:
        if no_ack:
            self._no_ack.add(queue)
        return super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)  # type: ignore[no-untyped-call]

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        cancelled = super().basic_cancel(consumer_tag)  # type: ignore[no-untyped-call]
        if queue is not None and queue not in self._active_queues:
            self._no_ack.discard(queue)
        return cancelled

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        if not no_ack:
            return super().basic_get(queue, no_ack=no_ack, **kwargs)  # type: ignore[no-untyped-call]
        taken = self.rows.take(queue, 1)
        return self.Message(taken[0], channel=self) if taken else None  # type: ignore[no-untyped-call]

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return True

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        self.rows.publish([self._item(queue, message)])

    def _item(self, queue: str, message: dict[str, Any]) -> tuple[str, dict[str, Any], int, float]:
        delay = delivery_delay(message.get("headers") or {}, time.time())
        priority: int = self._get_message_priority(message)  # type: ignore[no-untyped-call]
        return queue, message, priority, delay

    def basic_publish_many(self, messages: Sequence[dict[str, Any]], exchange: str, routing_key: str) -> None:
        """Publish prepared messages (``prepare_message``) to one routing key in one backend call."""
        items = []
        for message in messages:
            self._inplace_augment_message(message, exchange, routing_key)  # type: ignore[no-untyped-call]
            for queue in self._lookup(exchange, routing_key):
                items.append(self._item(queue, message))
        self.rows.publish(items)

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        taken = self.rows.claim(queue, 1)
        if not taken:
            raise Empty()
        return taken[0]

    def claim_for_consumers(self, queue: str) -> list[dict[str, Any]]:
        """What a consume on ``queue`` may take now: up to the prefetch room left (kombu's QoS)."""
        room = self.qos.can_consume_max_estimate()
        limit = UNLIMITED_BATCH if room is None else room
        if limit <= 0:
            return []
        return self.rows.take(queue, limit) if queue in self._no_ack else self.rows.claim(queue, limit)

    def adopt(self, payload: dict[str, Any]) -> Any:
        """A claimed payload as kombu's message, held unacked by this channel (what ``basic_get`` does)."""
        message = self.Message(payload, channel=self)  # type: ignore[no-untyped-call]
        self.qos.append(message, message.delivery_tag)
        return message

    def _size(self, queue: str) -> int:
        return self.rows.size(queue)

    def _purge(self, queue: str) -> int:
        return self.rows.purge(queue)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.rows.purge(queue)

    def _restore(self, message: Any) -> None:
        self.rows.give_back(message.delivery_tag)

    def _restore_at_beginning(self, message: Any) -> None:
        self.rows.give_back(message.delivery_tag)

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        self.rows.ack(delivery_tag)
        super().basic_ack(delivery_tag, multiple)  # type: ignore[no-untyped-call]
        if self._consumers:
            self.connection.room_freed()

    def basic_reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        if not requeue:
            self.rows.ack(delivery_tag)
        super().basic_reject(delivery_tag, requeue=requeue)  # type: ignore[no-untyped-call]
        if self._consumers:
            self.connection.room_freed()

    @property
    def consuming(self) -> list[str]:
        """The queues this channel consumes from, when its QoS has room."""
        if not self._consumers or not self.qos.can_consume():
            return []
        return list(self._active_queues)


class RowTransport(virtual.Transport):
    """A virtual transport whose ``drain_events`` claims rows and waits on the backend between claims."""

    Channel = RowChannel

    implements = virtual.Transport.implements.extend(
        asynchronous=True,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )

    #: Longest wait between two claims when no wake-up comes (a lost NOTIFY, a lapsed lease, an ETA row).
    polling_interval = 1.0

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)  # type: ignore[no-untyped-call]
        self._rows: RowBackend | None = None
        self._turn = 0
        self._kicked = False
        self._loop: Any = None
        self._fds: set[int] = set()
        self._bindings_refresh_at = 0.0

    def open_rows(self) -> RowBackend:
        raise NotImplementedError

    @property
    def rows(self) -> RowBackend:
        if self._rows is None:
            self._rows = self.open_rows()
        return self._rows

    def establish_connection(self) -> Any:
        # A database that cannot be reached fails the connect, as kombu's Redis channel's PING does:
        # kombu then retries it with its backoff ("Trying again in 2.00 seconds"). A connect that
        # succeeded without reaching it would start the consumer only to fail at once, restarting
        # Celery's consumer in a tight loop for the whole outage.
        self.rows.ping()
        return super().establish_connection()  # type: ignore[no-untyped-call]

    # -- in Celery's event loop (kombu's hub), as kombu's Redis transport is --------------------------
    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """Poll the backend's wake-ups in ``loop``: a NOTIFY or ``wake()`` claims for the consumers at once;
        every ``polling_interval`` a claim catches a lost notification, a lapsed lease, a row come due."""
        self._loop = loop
        self._fds = set()
        self._watch_fds()
        loop.call_repeatedly(self.polling_interval, self._on_poll)

    def _watch_fds(self) -> None:
        loop = self._loop
        if loop is None:
            return
        fds = set(self.rows.wakeup_fds())
        for fd in self._fds - fds:  # a LISTEN connection that broke and was reopened
            loop.remove_reader(fd)
        for fd in fds - self._fds:
            loop.add_reader(fd, self.on_wakeup, fd)
        self._fds = fds

    def on_wakeup(self, fileno: int) -> None:
        woken, queues = self.rows.take_wakeups()
        self._claim_for_consumers(None if woken else queues)

    def _on_poll(self) -> None:
        self._watch_fds()
        self._refresh_bindings()
        self._claim_for_consumers(None)

    def _refresh_bindings(self) -> None:
        """Every ``BINDINGS_REFRESH_INTERVAL``: the expiring queues consumed here are still in use (their
        bindings stay, or come back after this process was stopped); the lapsed ones of others go."""
        now = time.monotonic()
        if now < self._bindings_refresh_at:
            return
        consumed = [binding for channel in list(self.channels) for binding in channel.expiring_bindings()]
        if not consumed:
            return  # only a consumer of an expiring queue keeps bindings (and so cleans up after others)
        self._bindings_refresh_at = now + BINDINGS_REFRESH_INTERVAL
        self.rows.refresh_bindings(consumed)

    def _claim_for_consumers(self, notified: set[str] | None) -> None:
        # Until the consumers' prefetch room is full or their queues are dry; bounded, so a flood
        # cannot keep the loop from its other readers.
        for _ in range(MAX_CLAIMS_PER_WAKE):
            if not self._deliver_some(notified):
                return

    def room_freed(self) -> None:
        """An ack freed prefetch room on a consuming channel: in an event loop, claim again soon."""
        if self._loop is not None and self._rows is not None:
            self._rows.wake()

    def close_connection(self, connection: Any) -> None:
        loop, self._loop = self._loop, None
        for fd in self._fds:
            try:
                loop.remove_reader(fd)
            except Exception:  # noqa: BLE001 - a hub Celery reset has forgotten the fd already
                pass
        self._fds = set()
        try:
            super().close_connection(connection)  # type: ignore[no-untyped-call]
        finally:
            if self._rows is not None:
                self._rows.close()
                self._rows = None

    def wake(self) -> None:
        """End the current (or next) ``drain_events`` wait now, from any thread: a loop without a hub
        (``-P durable``'s polling loop) has work queued by another thread (a finished run's kick)."""
        self._kicked = True
        if self._rows is not None:
            self._rows.wake()

    def drain_events(self, connection: Any, timeout: float | None = None, **kwargs: Any) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.rows.clear_wakeups()
            self._refresh_bindings()
            if self._deliver_some():
                return
            left = self.polling_interval if deadline is None else min(deadline - time.monotonic(),
                                                                     self.polling_interval)
            if left <= 0 or self._kicked:
                self._kicked = False
                raise TimeoutError()  # socket.timeout, what kombu's callers catch
            self.rows.wait(left)

    def _deliver_some(self, notified: set[str] | None = None) -> bool:
        for channel in list(self.channels):
            queues = channel.consuming
            if notified is not None:
                queues = [queue for queue in queues if queue in notified]
            if not queues:
                continue
            self._turn = (self._turn + 1) % len(queues)
            for queue in queues[self._turn:] + queues[:self._turn]:
                taken = channel.claim_for_consumers(queue)
                for payload in taken:
                    self._deliver(payload, queue)  # type: ignore[no-untyped-call]
                if taken:
                    return True
        return False
