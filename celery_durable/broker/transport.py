"""The kombu transport ``durable+postgresql://…`` and ``durable+sqlite:///…``: kombu's virtual transport over
``durable_broker_messages``."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from celery_durable.broker import dead_letters, vacuum
from celery_durable.broker.backend import PgRows
from celery_durable.broker.sqlite_backend import SQLITE_POLLING_INTERVAL, SqliteRows
from celery_durable.compat.virtual_rows import RowChannel, RowTransport
from celery_durable.config import DEFAULT_LEASE_TTL, positive_seconds, whole_number
from celery_durable.errors import ConfigInvalid, StoreUnavailable
from celery_durable.store.unreachable import CONNECTION_ERRORS

#: The transport option (``broker_transport_options``) naming the lease TTL; else the app's setting.
LEASE_TTL_OPTION = "durable_lease_ttl"
#: The setting (or transport option) of the dead rows that make a claiming worker VACUUM the table.
VACUUM_SETTING = "durable_broker_vacuum_dead_rows"


class Channel(RowChannel):
    """A channel of the PostgreSQL broker (all its behaviour is ``RowChannel``'s over ``PgRows``)."""


class Transport(RowTransport):
    """Messages are rows of the durable store's database, claimed under leases (docs/pg-broker.md)."""

    Channel = Channel
    driver_type = "durable"
    driver_name = "psycopg2"
    default_port = 5432  # type: ignore[assignment]

    connection_errors = (*RowTransport.connection_errors, *CONNECTION_ERRORS, StoreUnavailable)
    channel_errors = (*RowTransport.channel_errors, sa.exc.DBAPIError)  # type: ignore[assignment]

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        options = getattr(client, "transport_options", None) or {}
        if options.get("polling_interval") is None and _backend(database_url(client)) == "sqlite":
            # No NOTIFY on SQLite: the poll is how an idle consumer hears of another process's rows.
            self.polling_interval = SQLITE_POLLING_INTERVAL

    def open_rows(self) -> PgRows | SqliteRows:
        url = database_url(self.client)
        backend = _backend(url)
        if backend not in ("postgresql", "sqlite"):
            raise ConfigInvalid("broker_url", f"durable+ needs a postgresql:// or sqlite:/// database URL, "
                                f"got {backend}://")
        app = _current_app()
        options = getattr(self.client, "transport_options", None)

        def bury(queue: str, payload: dict[str, Any], lapses: int) -> dead_letters.Burial | None:
            return dead_letters.bury(app, queue, payload, lapses)

        if backend == "sqlite":
            return SqliteRows(url, lease_ttl(options), bury=bury)
        return PgRows(url, lease_ttl(options), bury=bury, vacuum_dead_rows=vacuum_dead_rows(options))


def _backend(url: str) -> str:
    return sa.engine.make_url(url).get_backend_name()


def _current_app() -> Any:
    """The app of the process opening the connection (a worker's is the one it runs): its task registry
    tells the claim each task's budget."""
    from celery import current_app

    return current_app


def database_url(client: Any) -> str:
    """The database URL of a ``durable+<url>`` connection (kombu hands the part after ``durable+`` as hostname)."""
    hostname: str = client.hostname
    return hostname


def lease_ttl(options: Any) -> float:
    """The TTL of a claimed row's lease: the transport option, else the current app's ``durable_lease_ttl``."""
    value = options.get(LEASE_TTL_OPTION) if options else None
    if value is None:
        # A worker's and a producer's current app is the one they were started with; its
        # setting is the same TTL the durable runs' leases use.
        from celery import current_app

        value = current_app.conf.get("durable_lease_ttl")
    return DEFAULT_LEASE_TTL if value is None else positive_seconds("durable_lease_ttl", value)


def vacuum_dead_rows(options: Any) -> int:
    """``durable_broker_vacuum_dead_rows``: the transport option, else the current app's setting (0: never)."""
    value = options.get(VACUUM_SETTING) if options else None
    if value is None:
        from celery import current_app

        value = current_app.conf.get(VACUUM_SETTING)
    if value is None:
        return vacuum.DEFAULT_VACUUM_DEAD_ROWS
    return whole_number(VACUUM_SETTING, value, allow_zero=True)
