"""One kombu connection's view of the broker's rows on PostgreSQL: the statements of ``broker.rows``, its LISTEN."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from celery_durable.broker import in_transaction, rows, vacuum
from celery_durable.broker.claim_connection import ClaimConnection
from celery_durable.broker.holder import Bury, RowHolder
from celery_durable.broker.transient import TransientSender
from celery_durable.store.engine import autocommit, ensure_schema, lazy_commit
from celery_durable.store.notify import Waker


class PgRows(RowHolder):
    """The ``RowBackend`` of ``compat.virtual_rows`` on PostgreSQL (see ``broker.rows`` for the SQL)."""

    def __init__(self, url: str, lease_ttl: float, bury: Bury | None = None,
                 vacuum_dead_rows: int = vacuum.DEFAULT_VACUUM_DEAD_ROWS) -> None:
        super().__init__(lease_ttl, bury)
        self.url = url
        # Each call is one statement (a batch insert, a claim's CTE): autocommit spares a BEGIN and a COMMIT.
        self.engine = autocommit(ensure_schema(url))
        self.lazy = lazy_commit(self.engine)
        #: Claims, acks and renewals: one connection kept, straight to the driver (the per-run hot path).
        self.hot = ClaimConnection(self.lazy)
        #: Dead rows that make this process VACUUM the table once it claims (0: autovacuum alone).
        self._vacuum_dead_rows = vacuum_dead_rows
        self._vacuum: vacuum.TableVacuum | None = None
        self._waker: Waker | None = None
        self._transient = TransientSender(self._insert_transient)

    def publish(self, items: Sequence[tuple[str, dict[str, Any], int, float]]) -> None:
        outgoing = [rows.Outgoing(queue, payload, priority, delay) for queue, payload, priority, delay in items]
        binding = in_transaction.current()
        if binding is not None:
            # Inside celery_durable.transaction(): the caller's transaction decides whether they are sent.
            binding.insert(self.url, outgoing)
            return
        persistent: list[rows.Outgoing] = []
        transient: list[rows.Outgoing] = []
        for message in outgoing:
            (transient if rows.is_transient(message.payload) else persistent).append(message)
        if persistent:
            with self.engine.begin() as conn:
                rows.insert(conn, persistent)
        if transient:
            # Task events, remote control (delivery_mode 1): from a thread of their own, in batches
            # (broker/transient.py).
            self._transient.send(transient)

    def _insert_transient(self, messages: Sequence[rows.Outgoing]) -> None:
        # Kept through a process crash, not a database crash — RabbitMQ's rule for a transient message —
        # so the commit does not wait for the WAL flush.
        with self.lazy.begin() as conn:
            rows.insert(conn, messages)

    # -- the statements (RowHolder) ---------------------------------------------------------------------
    def _claim_rows(self, queue: str, limit: int, acked: list[int]) -> list[rows.Claimed]:
        return rows.claim(self.hot, queue, limit, self.holder, self.lease_ttl, acked)

    def _claim_pass_rows(self, queues: Sequence[str], free: Sequence[int], room: int | None,
                         acked: list[int]) -> list[rows.PassAsk]:
        return rows.claim_pass(self.hot, queues, free, room, self.holder, self.lease_ttl, acked)

    def _renew_rows(self) -> int:
        return rows.renew(self.hot, self.holder, self.lease_ttl)

    def _delete_rows(self, ids: list[int]) -> int:
        return rows.ack(self.hot, ids, self.holder)

    def _park_dead(self, row: rows.Claimed) -> None:
        rows.park_dead(self.lazy, row, self.holder)

    def _give_back_rows(self, ids: list[int]) -> int:
        return rows.give_back(self.lazy, ids, self.holder)

    def _on_holding(self) -> None:
        """The process's VACUUM of the dead rows claims leave runs while this connection holds rows."""
        if self._vacuum is None and os.getpid() == self._pid:
            self._vacuum = vacuum.for_process(self.engine, self._vacuum_dead_rows)
            self._vacuum.join()

    # -- the rest of the RowBackend protocol ----------------------------------------------------------
    def ping(self) -> None:
        """One round trip on a pooled connection of the store's engine (a producer's connect opens nothing more)."""
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    def size(self, queue: str) -> int:
        return rows.size(self.engine, queue)

    def readiness(self, queue: str) -> tuple[int, float | None]:
        return rows.readiness(self.engine, queue)

    def purge(self, queue: str) -> int:
        return rows.purge(self.engine, queue)

    def _wakeups(self) -> Waker:
        with self._lock:
            if self._waker is None:
                self._waker = Waker(self.engine, channel=rows.CHANNEL)
            return self._waker

    def clear_wakeups(self) -> None:
        self._wakeups().clear()

    def wakeup_fds(self) -> list[int]:
        return self._wakeups().fds()

    def take_wakeups(self) -> tuple[bool, set[str]]:
        return self._wakeups().take()

    def take_notified(self) -> set[str] | None:
        """The queues a NOTIFY named since the last call, or None if some may have gone unseen (no LISTEN
        open all along): what a claimer that skips queues it knows are empty must hear of."""
        with self._lock:
            waker = self._waker
        return None if waker is None else waker.take_seen()

    def wait(self, timeout: float) -> bool:
        self.flush_acks()
        return self._wakeups().wait(timeout)

    def wake(self) -> None:
        self._wakeups().wake()

    def close(self) -> None:
        self._transient.flush()
        if self._vacuum is not None:
            self._vacuum.leave()
            self._vacuum = None
        try:
            super().close()
        finally:
            if self._waker is not None:
                self._waker.close()
                self._waker = None
            self.hot.close()
