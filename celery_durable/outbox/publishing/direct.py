"""An outbox row's message sent straight into the caller's transaction, on the PostgreSQL broker of its database."""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

from sqlalchemy.engine import Connection

from celery_durable.broker.in_transaction import bound_to
from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.outbox.publishing.task_message import RowSender
from celery_durable.store.outbox import OutboxRow

#: One sender per broker channel: it remembers the routes it declared on that channel (see
#: ``RowSender.capture``), as kombu's virtual transport keeps bindings per connection; a
#: reconnected producer has a new channel, and so a sender that declares afresh.
_senders: WeakKeyDictionary[Any, RowSender] = WeakKeyDictionary()


def send_in_transaction(conn: Connection, app: Any, row: OutboxRow) -> None:
    """Send ``row`` as the relay would (same message, same ``task-sent`` event), each a broker row of ``conn``'s
    transaction: the broker's rows are in the caller's database, so the commit is the publish."""
    with bound_to(conn), app.producer_or_acquire() as producer:
        channel = producer.channel
        sender = _senders.get(channel)
        if sender is None or sender.app is not app:
            sender = _senders[channel] = RowSender(app, producer, SYSTEM_CLOCK)
        sender.producer = producer
        # No kombu retry: the row goes into the caller's transaction, where no reconnect could help.
        sender.send(row, retry=False, declare="once")
