"""SQL for the outbox table: insert in the caller's transaction, claim a batch, mark, purge, measure."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_durable.headers import OUTBOX_CHANNEL
from celery_durable.store.schema import outbox


@dataclass(frozen=True)
class OutboxRow:
    """One row the relay claimed."""

    id: int
    task_id: str
    task_name: str
    args: str
    kwargs: str
    options: str
    attempts: int


def insert_txn(conn: Connection, *, task_id: str, task_name: str, args: str, kwargs: str,
               options: str, at: datetime) -> None:
    """Insert a row in ``conn``'s current transaction; on PostgreSQL, NOTIFY the relays on commit."""
    conn.execute(outbox.insert().values(
        task_id=task_id, task_name=task_name, args=args, kwargs=kwargs, options=options,
        created_at=at, available_at=at, attempts=0,
    ))
    if conn.dialect.name == "postgresql":
        # Delivered only if the transaction commits (and once per transaction:
        # PostgreSQL folds identical notifications).
        conn.exec_driver_sql(f"NOTIFY {OUTBOX_CHANNEL}")


def claim(conn: Connection, limit: int, now: datetime) -> list[OutboxRow]:
    """Lock up to ``limit`` due unpublished rows, oldest first, for this transaction.

    PostgreSQL: rows another relay holds are skipped, so concurrent relays
    publish disjoint batches. SQLite: the transaction's BEGIN IMMEDIATE already
    admits one relay at a time.
    """
    query = (
        sa.select(outbox.c.id, outbox.c.task_id, outbox.c.task_name, outbox.c.args, outbox.c.kwargs,
                  outbox.c.options, outbox.c.attempts)
        .where(outbox.c.published_at.is_(None), outbox.c.available_at <= now)
        .order_by(outbox.c.id)
        .limit(limit)
    )
    if conn.dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    return [OutboxRow(*row) for row in conn.execute(query)]


def mark_published(conn: Connection, ids: list[int] | tuple[int, ...], at: datetime) -> None:
    if ids:
        conn.execute(outbox.update().where(outbox.c.id.in_(ids)).values(published_at=at))


def mark_failed(conn: Connection, row_id: int, *, attempts: int, error: str, retry_at: datetime) -> None:
    conn.execute(outbox.update().where(outbox.c.id == row_id)
                 .values(attempts=attempts, last_error=error, available_at=retry_at))


def release(conn: Connection, ids: list[int], now: datetime) -> int:
    """Make unpublished rows of ``ids`` deferred past ``now`` available at ``now``; returns how many."""
    result = conn.execute(outbox.update().where(outbox.c.id.in_(ids), outbox.c.published_at.is_(None),
                                                outbox.c.available_at > now).values(available_at=now))
    return int(result.rowcount or 0)


def purge_published(conn: Connection, before: datetime) -> int:
    """Delete rows published before ``before``; returns how many."""
    result = conn.execute(outbox.delete().where(outbox.c.published_at.is_not(None),
                                                outbox.c.published_at < before))
    return int(result.rowcount or 0)


def backlog(conn: Connection) -> tuple[int, datetime | None]:
    """(unpublished rows, creation time of the oldest)."""
    row = conn.execute(sa.select(sa.func.count(), sa.func.min(outbox.c.created_at))
                       .where(outbox.c.published_at.is_(None))).one()
    return int(row[0]), row[1]


def failing(conn: Connection, limit: int) -> list[dict[str, Any]]:
    """Unpublished rows whose publish failed (each keeps its last error), most attempts first."""
    query = (sa.select(outbox.c.task_id, outbox.c.task_name, outbox.c.attempts, outbox.c.last_error,
                       outbox.c.created_at, outbox.c.available_at)
             .where(outbox.c.published_at.is_(None), outbox.c.attempts > 0)
             .order_by(outbox.c.attempts.desc(), outbox.c.id).limit(limit))
    return [dict(row) for row in conn.execute(query).mappings()]


def get(conn: Connection, task_id: str) -> dict[str, Any] | None:
    row = conn.execute(sa.select(outbox).where(outbox.c.task_id == task_id)).mappings().first()
    return dict(row) if row is not None else None
