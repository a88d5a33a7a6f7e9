"""This thread's publishes bound to a caller's SQLAlchemy connection: message rows inserted in its transaction."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from celery_durable.broker import rows
from celery_durable.errors import OutboxDatabaseMismatch
from celery_durable.store.engine import database_identity
from celery_durable.store.urls import shown_url


@dataclass(frozen=True)
class Binding:
    """The caller's connection (in its open transaction) and the identity of its database."""

    connection: Connection
    identity: tuple[Any, ...]

    def insert(self, broker_url: str, messages: Sequence[rows.Outgoing]) -> None:
        """Insert ``messages`` through the caller's connection: they become visible when, and if, it commits."""
        if database_identity(broker_url) != self.identity:
            # A transport on another database cannot take part in the caller's transaction:
            # publishing on its own would send what the caller may yet roll back.
            raise OutboxDatabaseMismatch(
                f"a publish inside celery_durable.transaction() went to the broker on {shown_url(broker_url)}, "
                f"not the database of the transaction ({shown_url(self.connection.engine.url)})",
                setting="broker_url")
        rows.insert(self.connection, messages)


#: A context variable, not a thread-local: Celery publishes in the caller's thread, and an asyncio
#: task or a copied context keeps its own binding.
_binding: ContextVar[Binding | None] = ContextVar("celery_durable_broker_binding", default=None)


def current() -> Binding | None:
    """The binding of the innermost ``bound_to`` block around this call, if any."""
    return _binding.get()


@contextmanager
def bound_to(connection: Connection) -> Iterator[Binding]:
    """Within the block, every message this context publishes on the PostgreSQL broker is a row of ``connection``'s
    transaction (never committed here); blocks nest, the innermost wins."""
    binding = Binding(connection, database_identity(connection.engine.url))
    token = _binding.set(binding)
    try:
        yield binding
    finally:
        _binding.reset(token)
