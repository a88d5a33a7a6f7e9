"""The broker's hot path: one DB-API connection kept for a consumer's claims, acks and lease renewals.

A claim pass is the statement a worker makes for every run it starts. Through SQLAlchemy (a pool
checkout, the execution context, row objects, the pool's reset on return) one pass cost about
150 µs of Python on top of the statement's own ~100 µs (``benchmarks/PG_BROKER_RESULTS.md``); on a
worker whose hub thread also feeds the pool, that Python is the worker's throughput. So these
statements go straight to the driver on one connection held for the consumer's life: autocommit,
``synchronous_commit = off`` (``store.engine.lazy_commit``: a claim, ack or renewal a database crash
forgets hands its row out again, at least once). Everything else (publishes, parking, purges) keeps
the engine.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine


class ClaimConnection:
    """Runs one statement at a time on a connection of ``engine`` (a ``lazy_commit`` engine) kept open.

    Thread-safe: the heartbeat's renewal and the hub's claims share it under a lock. A driver
    error is raised as SQLAlchemy raises it (``OperationalError`` for a connection that died, which
    the transport's ``connection_errors`` name, so kombu reconnects); a connection that died is
    dropped and the next statement opens a fresh one. A forked child opens its own: the parent's
    socket is never shared.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._dbapi: Any = engine.dialect.dbapi
        self._fairy: Any = None
        self._pid = 0
        self._lock = threading.Lock()
        #: Called with (statement, parameters) before each statement: what SQLAlchemy's
        #: ``before_cursor_execute`` event is to an engine (tests and benchmarks count statements).
        self._listeners: list[Callable[[str, Mapping[str, Any]], None]] = []

    def listen(self, listener: Callable[[str, Mapping[str, Any]], None]) -> None:
        self._listeners.append(listener)

    def execute(self, sql: str, params: Mapping[str, Any]) -> tuple[list[tuple[Any, ...]], int]:
        """Run ``sql`` (the driver's ``%(name)s`` style) with ``params``: (its rows, its rowcount)."""
        with self._lock:
            fairy = self._connection(sql, params)
            for listener in self._listeners:
                listener(sql, params)
            try:
                cursor = fairy.dbapi_connection.cursor()
                try:
                    cursor.execute(sql, params)
                    found = cursor.fetchall() if cursor.description is not None else []
                    return found, cursor.rowcount
                finally:
                    cursor.close()
            except self._dbapi.Error as err:
                died = self.engine.dialect.is_disconnect(err, fairy.dbapi_connection, None) \
                    or fairy.dbapi_connection.closed
                if died:
                    self._drop()
                raise self._as_sqlalchemy(err, sql, params, died=bool(died)) from err

    def _connection(self, sql: str, params: Mapping[str, Any]) -> Any:
        if self._fairy is None or self._pid != os.getpid():
            try:
                self._fairy = self.engine.raw_connection()
            except self._dbapi.Error as err:
                # The pool hands the driver's own error on: raised as the engine's connect raises it
                # (OperationalError), one of the transport's connection errors, so kombu reconnects.
                raise self._as_sqlalchemy(err, sql, params, died=True) from err
            self._pid = os.getpid()
        return self._fairy

    def _as_sqlalchemy(self, err: Exception, sql: str, params: Mapping[str, Any], *, died: bool) -> Exception:
        """The driver's error as SQLAlchemy raises it (``OperationalError`` for a dead connection)."""
        wrapped: Exception = sa.exc.DBAPIError.instance(sql, dict(params), err, self._dbapi.Error,
                                                        connection_invalidated=died, dialect=self.engine.dialect)
        return wrapped

    def _drop(self) -> None:
        fairy, self._fairy = self._fairy, None
        if fairy is not None:
            try:
                fairy.invalidate()
            except Exception:  # noqa: BLE001 - a connection already dead: forgetting it is all that is left
                pass

    def close(self) -> None:
        with self._lock:
            fairy, self._fairy = self._fairy, None
            if fairy is not None and self._pid == os.getpid():
                fairy.close()
