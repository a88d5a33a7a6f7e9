"""The broker's message rows on SQLite: the table and rules of ``broker/rows.py``, one writer at a time.

SQLite has no ``SKIP LOCKED`` and needs none: a claim is one write transaction (``UPDATE … RETURNING``
over the queue's first ready rows), and the database lets one writer in at a time, so two claims never
take one row. No server functions either: a whole pass is the pure claim sweep
(``planning/claim_sweep.py``) run here, each ask a one-queue claim, all in one ``BEGIN IMMEDIATE``
transaction — the same asks the PostgreSQL function makes, so the worker's replay agrees.

Times are this host's clock (the store is a file on it, the only clock there is), written as
``YYYY-MM-DD HH:MM:SS.ffffff`` UTC text, the form SQLAlchemy writes the table's ``DateTime`` columns in:
text that sorts as the times do, so readiness and lease expiry compare as text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy.engine import Connection, Engine

from celery_durable.broker.rows import Claimed, Outgoing, PassAsk, decoded, log_parked, park
from celery_durable.clock import SYSTEM_CLOCK, Clock
from celery_durable.planning import claim_sweep
from celery_durable.store.engine import autocommit


def stamp(at: datetime) -> str:
    """``at`` (aware) as the UTC text the table's times are stored and compared in."""
    return at.astimezone(_UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


_UTC = SYSTEM_CLOCK.now().tzinfo

_INSERT = ("INSERT INTO durable_broker_messages (queue, priority, payload, enqueued_at, visible_at) "
           "VALUES (?, ?, ?, ?, ?)")

# The ready rows of a queue, higher priority first, then oldest; the holder, lease and counts set in the
# same statement. ``lapses`` counts a hand-out whose previous holder is still named: its lease lapsed (SET
# expressions read the row as it was).
_CLAIM = (
    "UPDATE durable_broker_messages SET holder = ?, lease_expires_at = ?, delivery_count = delivery_count + 1, "
    "lapses = lapses + (holder IS NOT NULL) "
    "WHERE id IN (SELECT id FROM durable_broker_messages WHERE queue = ? AND visible_at <= ? "
    "AND (holder IS NULL OR lease_expires_at < ?) ORDER BY priority DESC, id LIMIT ?) "
    "RETURNING id, queue, priority, payload, delivery_count, lapses"
)

# Which of some queues have a ready row: a read, so a poll that finds nothing never takes the write lock.
_READY = ("SELECT DISTINCT queue FROM durable_broker_messages WHERE queue IN ({marks}) AND visible_at <= ? "
          "AND (holder IS NULL OR lease_expires_at < ?)")

_RENEW = "UPDATE durable_broker_messages SET lease_expires_at = ? WHERE holder = ?"
_ACK = "DELETE FROM durable_broker_messages WHERE holder = ? AND id IN ({marks})"
_GIVE_BACK = ("UPDATE durable_broker_messages SET holder = NULL, lease_expires_at = NULL "
              "WHERE holder = ? AND id IN ({marks})")
_PURGE = ("DELETE FROM durable_broker_messages WHERE queue = ? "
          "AND (holder IS NULL OR lease_expires_at IS NULL OR lease_expires_at < ?)")


def _marks(count: int) -> str:
    return ",".join("?" * count)


def insert(conn: Connection, messages: Sequence[Outgoing], clock: Clock = SYSTEM_CLOCK) -> None:
    """Insert ``messages`` in the caller's transaction (visible on its commit), one prepared statement."""
    if not messages:
        return
    now = clock.now()
    enqueued = stamp(now)
    conn.exec_driver_sql(_INSERT, [
        (m.queue, m.priority, json.dumps(m.payload), enqueued,
         stamp(now + timedelta(seconds=max(m.delay, 0.0))) if m.delay > 0 else enqueued)
        for m in messages])


def ready_queues(engine: Engine, queues: Sequence[str], clock: Clock = SYSTEM_CLOCK) -> set[str]:
    """Which of ``queues`` have a ready row now (a read: it waits for no writer)."""
    if not queues:
        return set()
    now = stamp(clock.now())
    # In autocommit: the store's engine begins each transaction IMMEDIATE (a write lock), and a read needs none.
    with autocommit(engine).connect() as conn:
        found = conn.exec_driver_sql(_READY.format(marks=_marks(len(queues))), (*queues, now, now))
        return {row[0] for row in found}


def _claim_in(conn: Connection, queue: str, limit: int, holder: str, ttl: float, now: datetime,
              poison: list[tuple[int, str, str]]) -> tuple[list[Claimed], int]:
    """The one-queue claim on ``conn`` (in a write transaction): the readable rows in claim order, how many taken."""
    at = stamp(now)
    found = [tuple(row) for row in conn.exec_driver_sql(
        _CLAIM, (holder, stamp(now + timedelta(seconds=ttl)), queue, at, at, limit))]
    found.sort(key=lambda row: (-row[2], row[0]))  # RETURNING follows no order: the claim's is put back
    claimed = []
    for row_id, row_queue, priority, text, delivery_count, lapses in found:
        payload = decoded(text)
        if payload is None:
            poison.append((row_id, row_queue, text))
        else:
            claimed.append(Claimed(row_id, row_queue, priority, payload, delivery_count, lapses))
    return claimed, len(found)


def _delete_acked(conn: Connection, ids: Sequence[int], holder: str) -> int:
    if not ids:
        return 0
    return int(conn.exec_driver_sql(_ACK.format(marks=_marks(len(ids))), (holder, *ids)).rowcount)


def _park_poison(engine: Engine, poison: list[tuple[int, str, str]]) -> None:
    for row_id, queue, text in poison:
        log_parked(row_id, queue, text)
    if poison:
        park(engine, [row_id for row_id, _, _ in poison])


def claim(engine: Engine, queue: str, limit: int, holder: str, ttl: float, acked: Sequence[int] = (),
          clock: Clock = SYSTEM_CLOCK) -> list[Claimed]:
    """Take up to ``limit`` ready rows of ``queue`` for ``holder`` under a lease of ``ttl`` seconds, oldest first;
    ``acked`` (rows ``holder`` acked since) deleted in the same transaction. Nothing ready: no write at all."""
    if not acked and not ready_queues(engine, [queue], clock):
        return []
    poison: list[tuple[int, str, str]] = []
    with engine.begin() as conn:
        _delete_acked(conn, acked, holder)
        claimed, _ = _claim_in(conn, queue, limit, holder, ttl, clock.now(), poison)
    _park_poison(engine, poison)
    return claimed


def claim_pass(engine: Engine, queues: Sequence[str], free: Sequence[int], room: int | None, holder: str,
               ttl: float, acked: Sequence[int] = (), clock: Clock = SYSTEM_CLOCK) -> list[PassAsk]:
    """A whole claim pass over ``queues`` (in that order, already rotated) in one write transaction: the asks
    that took rows, as the pure sweep plans them. Only queues with a ready row are asked (a read first)."""
    ready = ready_queues(engine, queues, clock)
    if not ready and not acked:
        return []
    sweep = claim_sweep.begin_sweep(queues, dict(zip(queues, free, strict=True)), room, cursor=None)
    asks: list[PassAsk] = []
    poison: list[tuple[int, str, str]] = []
    with engine.begin() as conn:
        _delete_acked(conn, acked, holder)
        now = clock.now()
        while True:
            ask, sweep = claim_sweep.next_ask(sweep)
            if ask is None:
                break
            if ask.queue not in ready:
                sweep = claim_sweep.record(sweep, ask, 0)
                continue
            claimed, taken = _claim_in(conn, ask.queue, ask.count, holder, ttl, now, poison)
            sweep = claim_sweep.record(sweep, ask, taken)
            if taken:
                asks.append(PassAsk(ask.queue, ask.count, taken, claimed))
            if taken < ask.count:
                ready.discard(ask.queue)  # emptied: a second ask of it would find nothing
    _park_poison(engine, poison)
    return asks


def renew(engine: Engine, holder: str, ttl: float, clock: Clock = SYSTEM_CLOCK) -> int:
    """Extend the lease of every row ``holder`` holds to ``ttl`` seconds from now; how many."""
    with engine.begin() as conn:
        return int(conn.exec_driver_sql(_RENEW, (stamp(clock.now() + timedelta(seconds=ttl)), holder)).rowcount)


def ack(engine: Engine, ids: Sequence[int], holder: str) -> int:
    """Delete the rows ``holder`` still holds among ``ids``; a row another took after a lapse stays theirs."""
    if not ids:
        return 0
    with engine.begin() as conn:
        return _delete_acked(conn, ids, holder)


def give_back(engine: Engine, ids: Sequence[int], holder: str) -> int:
    """Clear the holder of ``ids``: each row is ready again in its own place (its id kept)."""
    if not ids:
        return 0
    with engine.begin() as conn:
        return int(conn.exec_driver_sql(_GIVE_BACK.format(marks=_marks(len(ids))), (holder, *ids)).rowcount)


_READINESS = ("SELECT count(*), min(max(enqueued_at, visible_at, coalesce(lease_expires_at, visible_at))) "
              "FROM durable_broker_messages WHERE queue = ? AND visible_at <= ? "
              "AND (holder IS NULL OR lease_expires_at < ?)")


def readiness(engine: Engine, queue: str, clock: Clock = SYSTEM_CLOCK) -> tuple[int, float | None]:
    """(ready rows of ``queue``, seconds the oldest has been ready or None if none is): a read, no lock.
    The stored times are UTC text of one format, so SQLite's ``max``/``min`` compare them as times."""
    now = clock.now()
    at = stamp(now)
    with autocommit(engine).connect() as conn:
        count, since = conn.exec_driver_sql(_READINESS, (queue, at, at)).one()
    if since is None:
        return int(count), None
    ready_at = datetime.strptime(since, "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=_UTC)
    return int(count), max((now - ready_at).total_seconds(), 0.0)


def purge(engine: Engine, queue: str, clock: Clock = SYSTEM_CLOCK) -> int:
    """Delete the rows of ``queue`` no live lease holds; how many."""
    with engine.begin() as conn:
        return int(conn.exec_driver_sql(_PURGE, (queue, stamp(clock.now()))).rowcount)


