"""Wake-ups: PostgreSQL LISTEN on a channel (the outbox's by default) plus a self-pipe, or the pipe alone (SQLite)."""

from __future__ import annotations

import logging
import os
import select
from collections.abc import Callable
from typing import Any

from sqlalchemy import exc
from sqlalchemy.engine import Engine

from celery_durable.headers import OUTBOX_CHANNEL

logger = logging.getLogger(__name__)


class Waker:
    """``wait(timeout)`` returns early on a committed outbox row (PostgreSQL) or on ``wake()``.

    The LISTEN connection is a dedicated DBAPI connection, not one of the
    pool's: it stays open for the relay's life. If it breaks, waits fall back
    to the timeout (polling) and it is reopened on the next wait.

    ``report`` is told each LISTEN that failed (its error) or worked (None):
    its owner knows its name in the logs and which outage tracker to tell,
    and a store that is out fails every wait's reopening.
    """

    def __init__(self, engine: Engine | None, channel: str = OUTBOX_CHANNEL,
                 report: Callable[[BaseException | None], None] | None = None) -> None:
        self._channel = channel
        self._report = report
        self._engine = engine if engine is not None and engine.dialect.name == "postgresql" else None
        self._listener: Any = None
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)

    @property
    def listening(self) -> bool:
        return self._listener is not None

    def open(self) -> None:
        if self._engine is None or self._listener is not None:
            return
        try:
            cargs, cparams = self._engine.dialect.create_connect_args(self._engine.url)
            conn = self._engine.dialect.connect(*cargs, **cparams)
            conn.autocommit = True
            # DB-API cursors are not context managers (psycopg2's happens to be one).
            cursor = conn.cursor()
            try:
                cursor.execute(f"LISTEN {self._channel}")
            finally:
                cursor.close()
            self._listener = conn
        except Exception as err:  # noqa: BLE001 - polling still delivers; reported, and tried again next wait
            self._failed(err)
            return
        if self._report is not None:
            self._report(None)

    def _failed(self, err: Exception) -> None:
        engine = self._engine
        failure: BaseException = err
        dbapi = engine.dialect.loaded_dbapi if engine is not None else None
        if engine is not None and dbapi is not None and isinstance(err, dbapi.Error):
            # The dedicated connection is the driver's own, outside SQLAlchemy: its error is classified
            # as SQLAlchemy would (an OperationalError for a refused connection), as every other call's is.
            failure = exc.DBAPIError.instance(f"LISTEN {self._channel}", None, err, dbapi.Error,
                                              connection_invalidated=engine.dialect.is_disconnect(err, None, None))
            failure.__cause__ = err
        if self._report is None:
            logger.warning("durable.listen_failed channel=%s", self._channel, exc_info=failure,
                           extra={"event": "durable.listen_failed", "channel": self._channel})
        else:
            self._report(failure)

    def clear(self) -> None:
        """Forget notifications seen so far (call just before reading the table)."""
        listener = self._listener
        if listener is not None:
            try:
                listener.poll()
                listener.notifies.clear()
            except Exception:  # noqa: BLE001 - a broken LISTEN connection is dropped; the table is read all the same
                self._drop()
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def fds(self) -> list[int]:
        """The file descriptors an event loop polls for a wake-up: the self-pipe's, and LISTEN's socket
        (opened here if it can be; it changes when a broken LISTEN connection is reopened)."""
        self.open()
        fds = [self._read_fd]
        if self._listener is not None:
            fds.append(int(self._listener.fileno()))
        return fds

    def take(self) -> tuple[bool, set[str]]:
        """Forget the wake-ups seen so far and say what they were: (woken by ``wake()``, the NOTIFY payloads)."""
        payloads: set[str] = set()
        listener = self._listener
        if listener is not None:
            try:
                listener.poll()
                payloads = {notify.payload for notify in listener.notifies}
                listener.notifies.clear()
            except Exception:  # noqa: BLE001 - a broken LISTEN connection is dropped; the caller claims anyway
                self._drop()
                return True, payloads
        woken = False
        try:
            while os.read(self._read_fd, 4096):
                woken = True
        except BlockingIOError:
            pass
        return woken, payloads

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; True if woken before it ran out."""
        self.open()
        fds: list[Any] = [self._read_fd]
        listener = self._listener
        if listener is not None:
            try:
                listener.poll()
                if listener.notifies:
                    return True
            except Exception:  # noqa: BLE001 - a broken LISTEN connection is dropped; the wait falls back to polling
                self._drop()
                listener = None
            else:
                fds.append(listener)
        if timeout <= 0:
            return False
        ready, _, _ = select.select(fds, [], [], timeout)
        return bool(ready)

    def wake(self) -> None:
        try:
            os.write(self._write_fd, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: a wake-up is already pending

    def close(self) -> None:
        self._drop()
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def _drop(self) -> None:
        if self._listener is not None:
            try:
                self._listener.close()
            except Exception:  # noqa: BLE001 - closing a connection already broken
                pass
            self._listener = None
