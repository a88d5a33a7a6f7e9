"""This thread's publishes bound to a caller's SQLAlchemy connection: message rows inserted in its transaction."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary, WeakSet

from sqlalchemy import event
from sqlalchemy.engine import Connection

from celery_durable.broker import rows, sqlite_rows
from celery_durable.errors import OutboxDatabaseMismatch, TransactionEnded
from celery_durable.store.engine import database_identity
from celery_durable.store.urls import shown_url


@dataclass(frozen=True)
class Binding:
    """The caller's connection (in its open transaction) and the identity of its database."""

    connection: Connection
    identity: tuple[Any, ...]

    def is_on(self, broker_url: str) -> bool:
        """Whether ``broker_url`` is the database of the caller's transaction."""
        return database_identity(broker_url) == self.identity

    def insert(self, broker_url: str, messages: Sequence[rows.Outgoing]) -> None:
        """Add ``messages`` to the caller's transaction: they become visible when, and if, it commits.

        Buffered, then inserted in one statement just before the caller's next statement on the
        connection (a query of theirs, a SAVEPOINT, a ROLLBACK TO, the ORM's flush) or its commit,
        so a burst of sends costs one INSERT and the transaction sees its own rows whenever it looks.
        """
        if database_identity(broker_url) != self.identity:
            # A transport on another database cannot take part in the caller's transaction:
            # publishing on its own would send what the caller may yet roll back.
            raise OutboxDatabaseMismatch(
                f"a publish inside celery_durable.transaction() went to the broker on {shown_url(broker_url)}, "
                f"not the database of the transaction ({shown_url(self.connection.engine.url)})",
                setting="broker_url")
        conn = self.connection
        if conn.closed:
            # A session committed inside the block gave its connection back: a row buffered on it
            # would be lost without a word.
            raise TransactionEnded(
                "a publish inside celery_durable.transaction() after its session or connection was closed "
                "(committed inside the block?): open the block inside the transaction it should join")
        if not conn.in_transaction():
            # Committed inside the block: the insert begins the connection's next transaction, as any
            # statement of the caller's would, and is sent when that one commits.
            insert(conn, messages)
            return
        buffered = _pending.get(conn)
        if buffered is None:
            _hook(conn)
            _pending[conn] = list(messages)
        else:
            buffered.extend(messages)


#: Rows sent in a caller's open transaction, not inserted yet (by its connection; gone with it).
_pending: WeakKeyDictionary[Connection, list[rows.Outgoing]] = WeakKeyDictionary()
_hooked: WeakSet[Connection] = WeakSet()


def flush(conn: Connection) -> None:
    """Insert the rows buffered for ``conn`` now, in one statement of its transaction."""
    buffered = _pending.pop(conn, None)
    if buffered:
        insert(conn, buffered)


def insert(conn: Connection, messages: Sequence[rows.Outgoing]) -> None:
    """Insert ``messages`` in ``conn``'s transaction, in its database's statement."""
    if conn.dialect.name == "sqlite":
        sqlite_rows.insert(conn, messages)
    else:
        rows.insert(conn, messages)


def _hook(conn: Connection) -> None:
    if conn in _hooked:
        return
    _hooked.add(conn)
    event.listen(conn, "before_execute", _before_execute)
    # Fired inside the commit, before the database's own: the rows are part of what commits.
    event.listen(conn, "commit", flush)
    event.listen(conn, "rollback", _drop)


def _before_execute(conn: Connection, *_: Any) -> None:
    flush(conn)


def _drop(conn: Connection) -> None:
    _pending.pop(conn, None)


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
