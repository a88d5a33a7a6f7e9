"""One kombu connection's view of the broker's rows: its holder identity, its held rows and their heartbeat."""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from celery_durable.broker import in_transaction, rows, vacuum
from celery_durable.broker.claim_connection import ClaimConnection
from celery_durable.broker.dead_letters import PARK, Burial
from celery_durable.broker.leases import Heartbeat, RowLeaseKeeper
from celery_durable.store.engine import autocommit, ensure_schema, lazy_commit
from celery_durable.store.notify import Waker


def new_holder() -> str:
    """A holder name unique to this connection: host, pid and a random part (a pid is reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class PgRows:
    """The ``RowBackend`` of ``compat.virtual_rows`` on PostgreSQL (see ``broker.rows`` for the SQL).

    The heartbeat starts with the first claim: a producer's connection never
    holds a row and never runs a thread. Delivery tags are row ids.
    """

    def __init__(self, url: str, lease_ttl: float,
                 bury: Callable[[str, dict[str, Any], int], Burial | None] | None = None,
                 vacuum_dead_rows: int = vacuum.DEFAULT_VACUUM_DEAD_ROWS) -> None:
        self.url = url
        #: Decides what a claim does with a row whose holders died (``dead_letters.bury``); None: deliver it.
        self._bury = bury
        self.lease_ttl = lease_ttl
        self.holder = new_holder()
        self._pid = os.getpid()
        # Each call is one statement (a batch insert, a claim's CTE): autocommit spares a BEGIN and a COMMIT.
        self.engine = autocommit(ensure_schema(url))
        self.lazy = lazy_commit(self.engine)
        #: Claims, acks and renewals: one connection kept, straight to the driver (the per-run hot path).
        self.hot = ClaimConnection(self.lazy)
        self._acked: list[int] = []
        self._keeper = RowLeaseKeeper(self.renew, lease_ttl)
        #: Dead rows that make this process VACUUM the table once it claims (0: autovacuum alone).
        self._vacuum_dead_rows = vacuum_dead_rows
        self._vacuum: vacuum.TableVacuum | None = None
        self._waker: Waker | None = None
        self._lock = threading.Lock()

    def publish(self, items: Sequence[tuple[str, dict[str, Any], int, float]]) -> None:
        outgoing = [rows.Outgoing(queue, payload, priority, delay) for queue, payload, priority, delay in items]
        binding = in_transaction.current()
        if binding is not None:
            # Inside celery_durable.transaction(): the caller's transaction decides whether they are sent.
            binding.insert(self.url, outgoing)
            return
        with self.engine.begin() as conn:
            rows.insert(conn, outgoing)

    def claim(self, queue: str, limit: int) -> list[dict[str, Any]]:
        acked = self._take_acks()
        try:
            taken = rows.claim(self.hot, queue, limit, self.holder, self.lease_ttl, acked)
        except BaseException:
            self._return_acks(acked)
            raise
        if taken:
            self._holding()
        return [_delivered(row) for row in self._live(taken)]

    def claim_pass(self, queues: Sequence[str], free: Sequence[int],
                   room: int | None) -> list[tuple[str, int, int, list[dict[str, Any]]]]:
        """A whole claim pass in one statement: each ask that took rows as (queue, count, taken, payloads)."""
        acked = self._take_acks()
        try:
            asks = rows.claim_pass(self.hot, queues, free, room, self.holder, self.lease_ttl, acked)
        except BaseException:
            self._return_acks(acked)
            raise
        if asks:
            self._holding()
        return [(ask.queue, ask.count, ask.taken, [_delivered(row) for row in self._live(ask.claimed)])
                for ask in asks]

    def _holding(self) -> None:
        """This connection holds rows: their heartbeat runs, and the process's VACUUM of the dead rows claims leave."""
        self._keeper.start()
        if self._vacuum is None and os.getpid() == self._pid:
            self._vacuum = vacuum.for_process(self.engine, self._vacuum_dead_rows)
            self._vacuum.join()

    def _live(self, taken: list[rows.Claimed]) -> list[rows.Claimed]:
        """The claimed rows to hand out: a row whose dead holders spent its task's budget is buried here,
        by the claim (deleted once its run is settled dead, or parked), never handed out as work."""
        if self._bury is None or not any(row.lapses for row in taken):
            return taken
        live = []
        for row in taken:
            burial = self._bury(row.queue, row.payload, row.lapses) if row.lapses else None
            if burial is None:
                live.append(row)
            elif burial.kind == PARK:
                rows.park_dead(self.lazy, rows.Claimed(row.id, row.queue, row.priority, burial.payload,
                                                       row.delivery_count, row.lapses), self.holder)
            else:
                rows.ack(self.hot, [row.id], self.holder)
        return live

    def beat_with(self, heartbeat: Heartbeat) -> None:
        """Renew this holder's rows on ``heartbeat`` (a ``-P durable`` worker's lease keeper): one beat per worker."""
        self._keeper.beat_with(heartbeat)

    def renew(self) -> int:
        self.flush_acks()
        return rows.renew(self.hot, self.holder, self.lease_ttl)

    def ack(self, tag: Any) -> None:
        # Deleted in one statement with the others acked since, before the next claim, idle wait,
        # heartbeat or close: acks in batches. Until then the row stays this holder's, renewed.
        with self._lock:
            self._acked.append(int(tag))

    def _take_acks(self) -> list[int]:
        if os.getpid() != self._pid:
            return []  # the parent's acks, not a forked child's to send
        with self._lock:
            acked, self._acked = self._acked, []
        return acked

    def _return_acks(self, acked: list[int]) -> None:
        with self._lock:
            self._acked[:0] = acked

    def flush_acks(self) -> None:
        acked = self._take_acks()
        if acked:
            try:
                rows.ack(self.hot, acked, self.holder)
            except BaseException:
                self._return_acks(acked)  # the next statement deletes them
                raise

    def give_back(self, tag: Any) -> None:
        if os.getpid() != self._pid:
            # A forked pool child running the finalizers it inherited (kombu restores a channel's
            # unacked messages at exit): those rows are the parent's, live, and stay its.
            return
        rows.give_back(self.lazy, [int(tag)], self.holder)

    def ping(self) -> None:
        """One round trip on a pooled connection of the store's engine (a producer's connect opens nothing more)."""
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    def size(self, queue: str) -> int:
        return rows.size(self.engine, queue)

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
        self._keeper.stop()
        if self._vacuum is not None:
            self._vacuum.leave()
            self._vacuum = None
        try:
            self.flush_acks()
        finally:
            if self._waker is not None:
                self._waker.close()
                self._waker = None
            self.hot.close()


def _delivered(row: rows.Claimed) -> dict[str, Any]:
    """The kombu payload of a claimed row: its row id as the delivery tag, redelivered from the second hand-out."""
    payload = row.payload
    properties = payload.setdefault("properties", {})
    properties["delivery_tag"] = row.id
    redelivered = row.delivery_count > 1
    properties.setdefault("delivery_info", {})["redelivered"] = redelivered
    payload["redelivered"] = redelivered
    return payload
