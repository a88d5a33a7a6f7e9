"""Cheap checks a backing-off outbox relay makes: does its store answer, does its broker accept a connection."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from celery_durable.store.engine import ensure_schema

#: Seconds a broker check may take to connect before it counts as "still down".
BROKER_PROBE_TIMEOUT = 2.0


def store_problem(url: str) -> str | None:
    """None if the store answers ``SELECT 1``; otherwise what went wrong."""
    try:
        engine = ensure_schema(url)
        for attempt in range(2):
            try:
                with engine.connect() as conn:
                    conn.exec_driver_sql("SELECT 1")
                return None
            except sa.exc.DBAPIError as err:
                # A pooled connection from before the outage fails once and SQLAlchemy drops
                # the pool's stale connections; the second try is on a fresh one. Without it
                # a store that is back would be seen one probe interval late.
                if not err.connection_invalidated or attempt:
                    raise
    except Exception as err:  # noqa: BLE001 - any failure means "still down"
        return _describe(err)
    return None


def broker_problem(app: Any, *, timeout: float = BROKER_PROBE_TIMEOUT) -> str | None:
    """None if the app's write broker accepts a new connection within ``timeout``; else what failed.

    A new connection, not one from the producer pool: a pooled connection the outage cut
    may still look connected until it is written to.
    """
    try:
        conn = app.connection_for_write(connect_timeout=timeout)
    except Exception as err:  # noqa: BLE001 - a URL kombu cannot parse is a problem to report, not raise
        return _describe(err)
    try:
        if conn.transport.driver_type == "redis":
            # redis-py takes its timeouts from the transport options, not connect_timeout.
            conn.transport_options = {**conn.transport_options, "socket_connect_timeout": timeout,
                                      "socket_timeout": timeout}
        # No retries: kombu's would sleep between them, and the relay probes again anyway.
        conn.ensure_connection(max_retries=0)
    except Exception as err:  # noqa: BLE001 - any failure means "still down"
        return _describe(err)
    finally:
        try:
            conn.release()
        except Exception:  # noqa: BLE001 - closing a connection that never opened
            pass
    return None


def _describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"
