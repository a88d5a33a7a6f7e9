"""``celery_durable.transaction(session)``: what Celery publishes in the block joins the caller's transaction."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from celery_durable.broker.in_transaction import bound_to
from celery_durable.errors import OutboxDatabaseMismatch, OutboxInvalid, TransactionUnsupported
from celery_durable.store.engine import database_identity, ensure_schema
from celery_durable.store.urls import broker_database, shown_url

__all__ = ["broker_in_database", "connection_of", "transaction"]


@contextmanager
def transaction(session_or_connection: Session | Connection, app: Any = None) -> Iterator[Connection]:
    """Send every ``apply_async``/``delay``/canvas of the block inside the caller's open transaction.

    Only on the broker that claims rows (``durable+postgresql://`` or ``durable+sqlite:///``) on
    the same database as ``session_or_connection``: each message Celery publishes in this context (a task, a
    chain's first step, a group's members, a ``task-sent`` event) is inserted as a broker row
    through the caller's connection, visible when the caller commits and gone if it rolls
    back. Nothing is committed here. ``app`` defaults to Celery's current app.

    Raises ``TransactionUnsupported`` on any other broker (use ``outbox.enqueue`` there) and
    ``OutboxDatabaseMismatch`` when the connection is on another database than the broker's.
    """
    conn = connection_of(session_or_connection, "celery_durable.transaction")
    if app is None:
        from celery import current_app

        app = current_app
    url = broker_in_database(app, conn)
    if url is None:
        broker = app.conf.broker_write_url or app.conf.broker_url
        if broker_database(_first(broker)) is None:
            raise TransactionUnsupported(
                f"celery_durable.transaction() needs the broker that claims rows (durable+postgresql://... "
                f"or durable+sqlite:///...), "
                f"the app's broker is {shown_url(str(_first(broker)))}: on this broker use "
                f"celery_durable.outbox.enqueue(session, signature), which the relay publishes after commit",
                setting="broker_url")
        raise OutboxDatabaseMismatch(
            f"celery_durable.transaction() needs a session or connection on the broker's database "
            f"({shown_url(str(broker_database(_first(broker))))}), got one on {shown_url(conn.engine.url)}: "
            f"its rows would not commit with your transaction", setting="broker_url")
    # The broker's table may be new to this database. Made on a connection of its own, committed: the
    # producer's broker connection checks the schema so, and would wait on a schema the caller's open
    # transaction was making (while the caller waits on the publish).
    ensure_schema(url)
    with bound_to(conn):
        yield conn


def broker_in_database(app: Any, conn: Connection) -> str | None:
    """The database URL of ``app``'s rows broker (``durable+``) when ``conn`` is on that database; else None."""
    url = broker_database(_first(app.conf.broker_write_url or app.conf.broker_url))
    if url is None or database_identity(url) != database_identity(conn.engine.url):
        return None
    return url


def connection_of(obj: Any, where: str) -> Connection:
    """The caller's connection, in its current transaction (a session's is begun if needed, never committed)."""
    if isinstance(obj, Session):
        return obj.connection()
    if isinstance(obj, Connection):
        return obj
    raise OutboxInvalid(f"{where} takes a SQLAlchemy Session or Connection, got {type(obj).__name__}")


def _first(broker_url: Any) -> Any:
    # A failover list (``a;b`` or a list): Celery writes to the first.
    if isinstance(broker_url, (list, tuple)):
        return broker_url[0] if broker_url else None
    if isinstance(broker_url, str):
        return broker_url.split(";")[0].strip()
    return broker_url
