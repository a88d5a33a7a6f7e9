"""What every row backend of a kombu connection shares, whatever its database: one holder of leased rows.

Its holder name, the acks it sends in batches, the heartbeat that renews its rows and the burial, at
claim, of rows whose holders kept dying. The statements themselves are each database's
(``broker/backend.py`` on PostgreSQL, ``broker/sqlite_backend.py`` on SQLite).
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy.engine import Engine

from celery_durable.broker import bindings, rows
from celery_durable.broker.dead_letters import PARK, Burial
from celery_durable.broker.leases import Heartbeat, RowLeaseKeeper
from celery_durable.compat.row_exchanges import Binding, Meta

T = TypeVar("T")

#: Decides what a claim does with a row whose holders died (``dead_letters.bury``); None: deliver it.
Bury = Callable[[str, dict[str, Any], int], Burial | None]


def new_holder() -> str:
    """A holder name unique to this connection: host, pid and a random part (a pid is reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class RowHolder(ABC):
    """One kombu connection's hold on the broker's rows. Delivery tags are row ids.

    The heartbeat starts with the first claim: a producer's connection never holds a row and never
    runs a thread.
    """

    #: The store's engine on the broker's database (each backend opens its own).
    engine: Engine

    def __init__(self, lease_ttl: float, bury: Bury | None) -> None:
        self._bury = bury
        self.lease_ttl = lease_ttl
        self.holder = new_holder()
        self._pid = os.getpid()
        self._acked: list[int] = []
        self._keeper = RowLeaseKeeper(self.renew, lease_ttl)
        self._lock = threading.Lock()
        self._tables = bindings.SharedTables(lambda exchange: bindings.table(self.engine, exchange))

    # -- the database's statements ---------------------------------------------------------------------
    @abstractmethod
    def _claim_rows(self, queue: str, limit: int, acked: list[int]) -> list[rows.Claimed]:
        """The one-queue claim, deleting ``acked`` (this holder's) first."""

    @abstractmethod
    def _claim_pass_rows(self, queues: Sequence[str], free: Sequence[int], room: int | None,
                         acked: list[int]) -> list[rows.PassAsk]:
        """A whole claim pass (the asks of ``planning/claim_sweep.py``), deleting ``acked`` first."""

    @abstractmethod
    def _renew_rows(self) -> int: ...

    @abstractmethod
    def _delete_rows(self, ids: list[int]) -> int:
        """Delete the rows this holder still holds among ``ids``."""

    @abstractmethod
    def _park_dead(self, row: rows.Claimed) -> None:
        """Move a held row to its queue's parking queue with its message as given."""

    @abstractmethod
    def _give_back_rows(self, ids: list[int]) -> int: ...

    def _holding(self) -> None:
        """This connection holds rows now: their heartbeat runs."""
        self._keeper.start()
        self._on_holding()

    @abstractmethod
    def _on_holding(self) -> None:
        """What the backend adds once its connection holds rows (the keeper already runs)."""

    # -- the RowBackend protocol's share ------------------------------------------------------------------
    def _with_acks(self, statement: Callable[[list[int]], T]) -> T:
        """Run a claim ``statement`` carrying this holder's acks since the last one; they are kept for the
        next statement if it fails."""
        acked = self._take_acks()
        try:
            return statement(acked)
        except BaseException:
            self._return_acks(acked)
            raise

    def claim(self, queue: str, limit: int) -> list[dict[str, Any]]:
        taken = self._with_acks(lambda acked: self._claim_rows(queue, limit, acked))
        if taken:
            self._holding()
        return [delivered(row) for row in self._live(taken)]

    def take(self, queue: str, limit: int) -> list[dict[str, Any]]:
        """Claim and delete at once, for a consumer without acks (a pidbox, a reply queue, an event receiver):
        nothing stays held, so no heartbeat starts for it. A process that dies in between leaves the rows
        to come back one lease later."""
        live = self._live(self._with_acks(lambda acked: self._claim_rows(queue, limit, acked)))
        if live:
            self._delete_rows([row.id for row in live])
        return [delivered(row) for row in live]

    def claim_pass(self, queues: Sequence[str], free: Sequence[int],
                   room: int | None) -> list[tuple[str, int, int, list[dict[str, Any]]]]:
        """A whole claim pass: each ask that took rows as (queue, count, taken, payloads)."""
        asks = self._with_acks(lambda acked: self._claim_pass_rows(queues, free, room, acked))
        if asks:
            self._holding()
        return [(ask.queue, ask.count, ask.taken, [delivered(row) for row in self._live(ask.claimed)])
                for ask in asks]

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
                self._park_dead(rows.Claimed(row.id, row.queue, row.priority, burial.payload,
                                             row.delivery_count, row.lapses))
            else:
                self._delete_rows([row.id])
        return live

    def beat_with(self, heartbeat: Heartbeat) -> None:
        """Renew this holder's rows on ``heartbeat`` (a ``-P durable`` worker's lease keeper): one beat per worker."""
        self._keeper.beat_with(heartbeat)

    def renew(self) -> int:
        self.flush_acks()
        return self._renew_rows()

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
                self._delete_rows(acked)
            except BaseException:
                self._return_acks(acked)  # the next statement deletes them
                raise

    def give_back(self, tag: Any) -> None:
        if os.getpid() != self._pid:
            # A forked pool child running the finalizers it inherited (kombu restores a channel's
            # unacked messages at exit): those rows are the parent's, live, and stay its.
            return
        self._give_back_rows([int(tag)])

    # -- the bindings other processes route by (broker/bindings.py) --------------------------------------
    def bind(self, binding: Binding) -> None:
        bindings.bind(self.engine, binding)

    def unbind(self, queue: str, exchange: str | None = None, routing_key: str | None = None) -> None:
        bindings.unbind(self.engine, queue, exchange, routing_key)

    def shared_table(self, exchange: str, *, fresh: bool) -> list[Meta]:
        return self._tables.get(exchange, fresh=fresh)

    def refresh_bindings(self, consumed: Sequence[Binding]) -> list[str]:
        return bindings.refresh(self.engine, consumed)

    def close(self) -> None:
        self._keeper.stop()
        self.flush_acks()


def delivered(row: rows.Claimed) -> dict[str, Any]:
    """The kombu payload of a claimed row: its row id as the delivery tag, redelivered from the second hand-out."""
    payload = row.payload
    properties = payload.setdefault("properties", {})
    properties["delivery_tag"] = row.id
    redelivered = row.delivery_count > 1
    properties.setdefault("delivery_info", {})["redelivered"] = redelivered
    payload["redelivered"] = redelivered
    return payload
