"""One kombu connection's view of the broker's rows on SQLite (``durable+sqlite:///file``): no LISTEN, a cheap poll.

SQLite has no notifications between processes, so a consumer learns of a new row by polling: the
transport's ``polling_interval`` (``SQLITE_POLLING_INTERVAL`` unless the transport option says
otherwise), each poll one read of which of its queues have a ready row — no write lock is taken
unless one has. Within a process a ``wake()`` (an ack that freed room, a finished run) ends a wait at
once through a self-pipe.
"""

from __future__ import annotations

import os
import select
from collections.abc import Sequence
from typing import Any

from celery_durable.broker import bindings, in_transaction, rows, sqlite_rows
from celery_durable.broker.holder import Bury, RowHolder
from celery_durable.compat.row_exchanges import Binding
from celery_durable.store.engine import autocommit, ensure_schema

#: Seconds between two polls of an idle consumer's queues: the most a new row waits for a worker that is idle.
SQLITE_POLLING_INTERVAL = 0.05


class SqliteRows(RowHolder):
    """The ``RowBackend`` of ``compat.virtual_rows`` on SQLite (see ``broker.sqlite_rows`` for the SQL)."""

    def __init__(self, url: str, lease_ttl: float, bury: Bury | None = None) -> None:
        super().__init__(lease_ttl, bury)
        self.url = url
        #: The store's engine: WAL, a busy timeout, ``BEGIN IMMEDIATE`` for each write transaction.
        self.engine = ensure_schema(url)
        #: Reads (a ping, a size): no write lock taken.
        self.reads = autocommit(self.engine)
        self._reader, self._writer = os.pipe()
        os.set_blocking(self._reader, False)
        os.set_blocking(self._writer, False)

    def publish(self, items: Sequence[tuple[str, dict[str, Any], int, float]]) -> None:
        outgoing = [rows.Outgoing(queue, payload, priority, delay) for queue, payload, priority, delay in items]
        binding = in_transaction.current()
        if binding is not None:
            # Inside celery_durable.transaction(): the caller's transaction decides whether they are sent.
            binding.insert(self.url, outgoing)
            return
        with self.engine.begin() as conn:
            sqlite_rows.insert(conn, outgoing)

    def bind(self, binding: Binding) -> None:
        caller = in_transaction.current()
        if caller is not None and caller.is_on(self.url):
            # A queue declared by a send inside the caller's transaction: that transaction may hold SQLite's
            # one write lock, so the binding is written in it (rolled back with it: this process routes by
            # its own bindings anyway, and every other process that sends to the queue declares it).
            bindings.bind_on(caller.connection, binding)
            return
        super().bind(binding)

    # -- the statements (RowHolder) ---------------------------------------------------------------------
    def _claim_rows(self, queue: str, limit: int, acked: list[int]) -> list[rows.Claimed]:
        return sqlite_rows.claim(self.engine, queue, limit, self.holder, self.lease_ttl, acked)

    def _claim_pass_rows(self, queues: Sequence[str], free: Sequence[int], room: int | None,
                         acked: list[int]) -> list[rows.PassAsk]:
        return sqlite_rows.claim_pass(self.engine, queues, free, room, self.holder, self.lease_ttl, acked)

    def _renew_rows(self) -> int:
        return sqlite_rows.renew(self.engine, self.holder, self.lease_ttl)

    def _delete_rows(self, ids: list[int]) -> int:
        return sqlite_rows.ack(self.engine, ids, self.holder)

    def _park_dead(self, row: rows.Claimed) -> None:
        rows.park_dead(self.engine, row, self.holder)

    def _give_back_rows(self, ids: list[int]) -> int:
        return sqlite_rows.give_back(self.engine, ids, self.holder)

    def _on_holding(self) -> None:
        """Nothing more: SQLite reuses a deleted row's space itself, there is no VACUUM to keep up with."""

    # -- the rest of the RowBackend protocol ----------------------------------------------------------
    def ping(self) -> None:
        with self.reads.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    def size(self, queue: str) -> int:
        return rows.size(self.reads, queue)

    def readiness(self, queue: str) -> tuple[int, float | None]:
        return sqlite_rows.readiness(self.engine, queue)

    def purge(self, queue: str) -> int:
        return sqlite_rows.purge(self.engine, queue)

    def clear_wakeups(self) -> None:
        self._drain()

    def wakeup_fds(self) -> list[int]:
        return [self._reader]

    def take_wakeups(self) -> tuple[bool, set[str]]:
        return self._drain(), set()

    def take_notified(self) -> set[str] | None:
        """None: no notification names a queue here, so a claimer keeps no queue known empty past its pass."""
        return None

    def wait(self, timeout: float) -> bool:
        self.flush_acks()
        readable, _, _ = select.select([self._reader], [], [], max(timeout, 0.0))
        return bool(readable)

    def wake(self) -> None:
        try:
            os.write(self._writer, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: one more says nothing new
        except OSError:
            pass  # closed: the connection is gone, nothing waits on it

    def _drain(self) -> bool:
        woken = False
        while True:
            try:
                data = os.read(self._reader, 4096)
            except (BlockingIOError, OSError):
                return woken
            if not data:
                return woken
            woken = True

    def close(self) -> None:
        try:
            super().close()
        finally:
            for fd in (self._reader, self._writer):
                try:
                    os.close(fd)
                except OSError:
                    pass
