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
        #: NOTIFY payloads read and not yet taken by ``take`` (the wake-up's reader) ...
        self._pending: set[str] = set()
        #: ... and by ``take_seen`` (a claimer's record of queues that got rows), kept apart: each
        #: reader forgets only what it was told.
        self._seen: set[str] = set()
        #: Notifications may have gone unseen since the last ``take_seen`` (no LISTEN yet, or it broke).
        self._lost = True
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

    def _collect(self) -> tuple[bool, bool]:
        """Read the notifications that arrived into both readers' records: (LISTEN still open — it is
        dropped if it broke —, any new one read)."""
        listener = self._listener
        if listener is None:
            return True, False
        try:
            listener.poll()
            if not listener.notifies:
                return True, False
            payloads = {notify.payload for notify in listener.notifies}
            listener.notifies.clear()
        except Exception:  # noqa: BLE001 - a broken LISTEN connection is dropped; callers claim or poll anyway
            self._drop()
            return False, False
        self._pending |= payloads
        self._seen |= payloads
        return True, True

    def clear(self) -> None:
        """Forget notifications seen so far (call just before reading the table)."""
        self._collect()
        self._pending.clear()
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
        listening, _ = self._collect()
        payloads, self._pending = self._pending, set()
        if not listening:
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
        if self._collect()[0] and self._pending:  # a LISTEN that broke is dropped: the wait falls back to polling
            return True
        listener = self._listener
        if listener is not None:
            fds.append(listener)
        if timeout <= 0:
            return False
        ready, _, _ = select.select(fds, [], [], timeout)
        return bool(ready)

    def heard(self, payload: str) -> bool:
        """Whether a NOTIFY of ``payload`` has been read since the last ``take_seen`` (reading any waiting now,
        keeping them for both readers): for a caller that must know its own notification arrived, when
        other notifications on the database-wide channel may have made the socket readable first."""
        self._collect()
        return payload in self._seen

    def take_seen(self) -> set[str] | None:
        """The NOTIFY payloads read since the last call (reading any waiting now), or None when some may
        have been missed since then: LISTEN was not open all along (not yet, or broken and reopened)."""
        listening, read = self._collect()
        if read:
            # Read off the socket here, the event loop will not see them arrive: wake its reader
            # (``take``), which would otherwise leave them to the next poll, an idle consumer waiting.
            self.wake()
        listening = listening and self._listener is not None
        seen, self._seen = self._seen, set()
        if not listening or self._lost:
            self._lost = not listening
            return None
        return seen

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
        self._lost = True
        if self._listener is not None:
            try:
                self._listener.close()
            except Exception:  # noqa: BLE001 - closing a connection already broken
                pass
            self._listener = None
