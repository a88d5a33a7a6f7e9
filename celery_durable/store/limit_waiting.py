"""SQL for the messages fleet limits park: kept whole while they wait, read back when their turn is due.

A parked message's row names the scope it waits on (or its task's rate turn)
and has no ``publish_at`` while it waits; a release or sweep that finds room
books a lease for it and sets ``publish_at`` (``store.limits``), and a
worker's limit dispatcher claims the due rows, publishes them and forgets them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_durable.planning.limit_declarations import Scope
from celery_durable.store.schema import limit_waiting as waiting


@dataclass(frozen=True)
class WaitingMessage:
    """A broker message as it is kept while it waits (see ``schema.limit_waiting``)."""

    task_id: str
    queue: str
    exchange: str
    routing_key: str
    body: bytes
    headers: str
    properties: str
    content_type: str
    content_encoding: str


@dataclass(frozen=True)
class ReadyMessage:
    """A waiting message due to be published: its row id, and the message as kept."""

    id: int
    message: WaitingMessage


def park(conn: Connection, rows: list[dict[str, Any]]) -> None:
    # A plain INSERT: SQLAlchemy caches it and sends the rows as one multi-row
    # statement. The batch left out the ids that have a row (take_batch read them
    # under the scopes' locks), so the unique task id is not expected to clash.
    conn.execute(waiting.insert(), rows)


def rows_of(conn: Connection, task_ids: list[str]) -> dict[str, datetime | None]:
    """The ids of ``task_ids`` that have a row, and each row's ``publish_at`` (None while it waits)."""
    return {task_id: publish_at for task_id, publish_at in conn.execute(
        sa.select(waiting.c.task_id, waiting.c.publish_at).where(waiting.c.task_id.in_(task_ids)))}


def wait_again(conn: Connection, row: dict[str, Any]) -> bool:
    """The row of ``row``'s task id, made ready, waits again where ``row`` says; False if it is gone."""
    return bool(conn.execute(waiting.update().where(waiting.c.task_id == row["task_id"]).values(
        task_name=row["task_name"], kind=row["kind"], key=row["key"], publish_at=row["publish_at"])).rowcount)


def waiting_on(conn: Connection, scope: Scope) -> int:
    """How many messages wait on ``scope`` (not yet made ready)."""
    return int(conn.execute(sa.select(sa.func.count()).select_from(waiting).where(
        waiting.c.task_name == scope.task, waiting.c.kind == scope.kind, waiting.c.key == scope.key,
        waiting.c.publish_at.is_(None))).scalar_one())


def oldest_waiting(conn: Connection, scope: Scope, count: int) -> list[tuple[int, str]]:
    """The (row id, task id) of the ``count`` messages waiting longest on ``scope``."""
    return [(row_id, task_id) for row_id, task_id in conn.execute(
        sa.select(waiting.c.id, waiting.c.task_id)
        .where(waiting.c.task_name == scope.task, waiting.c.kind == scope.kind,
               waiting.c.key == scope.key, waiting.c.publish_at.is_(None))
        .order_by(waiting.c.id).limit(count))]


def mark_due(conn: Connection, ids: list[int], now: datetime) -> None:
    """The rows ``ids`` are due to be published from ``now``."""
    conn.execute(waiting.update().where(waiting.c.id.in_(ids)).values(publish_at=now))


def scopes_waited_on(conn: Connection) -> list[tuple[str, str, str]]:
    """Every (task, kind, key) some message waits on (not yet made ready)."""
    return [(task, kind, key) for task, kind, key in conn.execute(
        sa.select(waiting.c.task_name, waiting.c.kind, waiting.c.key)
        .where(waiting.c.publish_at.is_(None)).distinct())]


def claim_ready(conn: Connection, limit: int, now: datetime) -> list[ReadyMessage]:
    """Lock up to ``limit`` waiting messages due now, oldest turn first (another dispatcher's are skipped)."""
    query = (sa.select(waiting.c.id, waiting.c.task_id, waiting.c.queue, waiting.c.exchange, waiting.c.routing_key,
                       waiting.c.body, waiting.c.headers, waiting.c.properties, waiting.c.content_type,
                       waiting.c.content_encoding)
             .where(waiting.c.publish_at <= now).order_by(waiting.c.publish_at, waiting.c.id).limit(limit))
    if conn.dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    return [ReadyMessage(row_id, WaitingMessage(*fields)) for row_id, *fields in conn.execute(query)]


def forget(conn: Connection, ids: Iterable[int]) -> None:
    """Delete waiting messages once published."""
    ids = list(ids)
    if ids:
        conn.execute(waiting.delete().where(waiting.c.id.in_(ids)))


def next_publish_at(conn: Connection) -> datetime | None:
    value: datetime | None = conn.execute(sa.select(sa.func.min(waiting.c.publish_at))).scalar()
    return value


def waiting_counts(conn: Connection) -> list[tuple[str, str, str, int]]:
    """Messages waiting per scope: (task, kind, key, count)."""
    rows = conn.execute(sa.select(waiting.c.task_name, waiting.c.kind, waiting.c.key, sa.func.count())
                        .group_by(waiting.c.task_name, waiting.c.kind, waiting.c.key)).all()
    return [(t, k, key, int(n)) for t, k, key, n in rows]


def waiting_by_scope(conn: Connection) -> list[tuple[str, str, str, int, int, datetime, datetime | None]]:
    """Per scope: (task, kind, key, waiting, made ready, oldest row's creation, earliest ``publish_at``)."""
    ready = sa.case((waiting.c.publish_at.is_not(None), 1), else_=0)
    rows = conn.execute(sa.select(waiting.c.task_name, waiting.c.kind, waiting.c.key, sa.func.count(),
                                  sa.func.sum(ready), sa.func.min(waiting.c.created_at),
                                  sa.func.min(waiting.c.publish_at))
                        .group_by(waiting.c.task_name, waiting.c.kind, waiting.c.key)).all()
    return [(t, k, key, int(n) - int(made or 0), int(made or 0), oldest, due)
            for t, k, key, n, made, oldest, due in rows]
