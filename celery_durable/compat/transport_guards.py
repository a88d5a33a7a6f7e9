"""Guards on kombu's own reads that raise on a poison item: they park it and read on instead.

Two kombu reads decode an item they have already taken off the broker, and
raise out of the worker's loop if it is not a kombu message (the item lost,
the worker exiting 1):

- Redis ``Channel._brpop_read`` (the idle wait's push delivery): BRPOP pops
  the item, then ``loads`` and ``Message`` run before it is recorded unacked;
- the SQLAlchemy transport's ``Channel._get`` (every get and the idle wait's
  polling): it hides the row, commits, then ``loads`` it.

Each guard replaces the method on one channel instance with a copy of kombu
5.7's that screens the item first (the worker's parking policy, passed in);
both are private kombu names (``_brpop_read``, ``_queue_cycle``, ``_in_poll``,
``connection._deliver``, ``Message._raw``; ``_get``, ``_get_or_create``),
pinned by tests/compat/test_transport_guards.py and exercised on real brokers by
tests/integration/test_poison.py and tests/e2e/test_poison.py.
"""

from __future__ import annotations

from queue import Empty
from typing import Any, Protocol

from kombu.utils.encoding import bytes_to_str


class PoisonPolicy(Protocol):
    """What the worker does with an item that is not a kombu message (``worker.parking``)."""

    def envelope(self, channel: Any, raw: Any) -> tuple[Any, str | None]: ...

    def park_redis_items(self, client: Any, qos: Any, queue: str, items: list[tuple[Any, Any, str]]) -> None: ...

    def parked_name(self, queue: str) -> str: ...

    def log_parked(self, queue: str, raw: Any, reason: str) -> None: ...


def guard_channel(channel: Any, poison: PoisonPolicy) -> Any:
    """Install the poison guard for ``channel``'s transport, if it needs one; returns the channel."""
    driver = channel.connection.client.transport.driver_type
    if driver == "redis":
        _guard_redis_brpop(channel, poison)
    elif driver == "sql":
        _guard_sql_get(channel, poison)
    return channel


def message_raw(message: Any) -> Any:
    """A virtual-transport message's payload as stored (``Message._raw``, kombu 5.x virtual/base.py)."""
    return message._raw


def put_raw(channel: Any, queue: str, raw: Any) -> None:
    """Put a stored payload back on ``queue`` of a virtual transport (``Channel._put``, kombu 5.x)."""
    channel._put(queue, raw)


def _guard_redis_brpop(channel: Any, poison: PoisonPolicy) -> None:
    def brpop_read(**options: Any) -> bool:
        try:
            try:
                reply = channel.client.parse_response(channel.client.connection, "BRPOP", **options)
            except channel.connection_errors:
                # As kombu: the next iteration reconnects.
                channel.client.connection.disconnect()
                raise
            if not reply:
                raise Empty()
            dest, item = reply
            dest = bytes_to_str(dest).rsplit(channel.sep, 1)[0]
            channel._queue_cycle.rotate(dest)
            message, reason = poison.envelope(channel, item)
            if message is None:
                # Popped but never recorded unacked: the parked list is its only copy.
                with channel.conn_or_acquire() as client:
                    poison.park_redis_items(client, channel.qos, dest, [(item, None, reason or "")])
                raise Empty()
            channel.connection._deliver(message._raw, dest)
            return True
        finally:
            channel._in_poll = None
            flush = getattr(channel, "_flush_brpop_reauth", None)
            if flush is not None:
                flush()

    channel._brpop_read = brpop_read
    channel.handlers["BRPOP"] = brpop_read


def _guard_sql_get(channel: Any, poison: PoisonPolicy) -> None:
    from sqlalchemy import text

    parked_ids: dict[str, Any] = {}

    def get(queue: str) -> Any:
        obj = channel._get_or_create(queue)
        parked = parked_ids.get(queue)
        if parked is None:
            # Made before the read's transaction: _get_or_create commits.
            parked = parked_ids[queue] = channel._get_or_create(poison.parked_name(queue)).id
        session = channel.session
        model = channel.message_cls
        while True:
            if session.bind.name == "sqlite":
                session.execute(text("BEGIN IMMEDIATE TRANSACTION"))
            try:
                row = (session.query(model).with_for_update()
                       .filter(model.queue_id == obj.id)
                       .filter(model.visible != False)  # noqa: E712 - SQL, as kombu writes it (NULL is not visible)
                       .order_by(model.sent_at).order_by(model.id)
                       .limit(1).first())
                if row is None:
                    raise Empty()
                raw = row.payload
                message, reason = poison.envelope(channel, raw)
                if message is not None:
                    row.visible = False
                    return message._raw
                # Moved, not hidden: the row keeps its bytes and stays
                # readable in the parked queue.
                row.queue_id = parked
            finally:
                session.commit()
            poison.log_parked(queue, raw, reason or "")

    channel._get = get
