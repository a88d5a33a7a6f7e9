"""Moving the waiting messages of kombu's SQLAlchemy broker (``sqla+…``) into the broker that claims rows.

kombu's SQLAlchemy transport keeps each message as a ``kombu_message`` row (its ``payload`` the kombu
message as JSON: the same text this broker stores) in a queue of ``kombu_queue``, ``visible`` until a
consumer takes it. A message a consumer took and never acked (a worker still running, or one that was
killed: kombu restores only on a clean close) stays invisible for good; it is left where it is unless
asked for, since its task may have run already.

A batch is inserted into the new table, then deleted from the old one. On one database that is one
transaction (each message moved exactly once); across two databases it is two, so a crash between
them leaves the batch in both (run the command again: the old copies are moved a second time — at
least once, as a broker hand-over can be).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_durable.broker import rows
from celery_durable.broker.in_transaction import insert
from celery_durable.compat.virtual_rows import delivery_delay
from celery_durable.store.engine import database_identity, ensure_schema

#: kombu's SQLAlchemy transport's default table names (its ``queue_tablename``/``message_tablename`` options).
QUEUE_TABLE, MESSAGE_TABLE = "kombu_queue", "kombu_message"

#: Highest priority a row keeps (RabbitMQ's and kombu's virtual transports' bound).
MAX_PRIORITY = 9

#: A table name this module will put in SQL text (a name cannot be a bound parameter).
_TABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


@dataclass
class Moved:
    """What a migration did: messages moved per queue, and what it left in the old tables."""

    by_queue: dict[str, int] = field(default_factory=dict)
    #: Taken by a consumer and never acked, left (``include_taken`` moves them).
    taken_left: int = 0
    #: Not a kombu message (its payload is not a JSON object), left for a person to read.
    unreadable: int = 0

    @property
    def total(self) -> int:
        return sum(self.by_queue.values())


# -- pure: one old row as a new one ----------------------------------------------------------------------
def outgoing_of(queue: str, payload_text: str, now: float) -> rows.Outgoing | None:
    """The new row for an old message: its queue, the kombu message, its priority (0–9) and what is left of
    its countdown/ETA; None when the payload is not a kombu message."""
    try:
        payload = json.loads(payload_text)
    except ValueError:
        return None
    if not isinstance(payload, dict):
        return None
    properties = payload.get("properties")
    headers = payload.get("headers")
    given = properties.get("priority") if isinstance(properties, dict) else None
    try:
        priority = max(0, min(int(given or 0), MAX_PRIORITY))
    except (TypeError, ValueError):
        priority = 0
    return rows.Outgoing(queue, payload, priority, delivery_delay(headers if isinstance(headers, dict) else {}, now))


# -- the I/O ---------------------------------------------------------------------------------------------
def migrate(source_url: str, target_url: str, *, queues: Sequence[str] = (), include_taken: bool = False,
            batch: int = 500, queue_table: str = QUEUE_TABLE, message_table: str = MESSAGE_TABLE) -> Moved:
    """Move the waiting messages at ``source_url`` (the database of an ``sqla+`` broker) into the broker's table
    at ``target_url``, oldest first, ``batch`` at a time; only ``queues`` when given."""
    moved = Moved()
    target = ensure_schema(target_url)
    one_database = database_identity(source_url) == database_identity(target_url)
    source = target if one_database else sa.create_engine(source_url)
    old = _OldTables(queue_table, message_table)
    after = 0
    try:
        while True:
            with source.connect() as conn:
                found = old.waiting(conn, after, queues, include_taken, batch)
            if not found:
                break
            after = found[-1].id
            outgoing, ids = [], []
            for row in found:
                message = outgoing_of(row.queue, row.payload, time.time())
                if message is None:
                    moved.unreadable += 1
                    continue
                outgoing.append(message)
                ids.append(row.id)
            if one_database:
                with target.begin() as conn:
                    insert(conn, outgoing)
                    old.delete(conn, ids)
            else:
                with target.begin() as conn:
                    insert(conn, outgoing)
                with source.begin() as conn:
                    old.delete(conn, ids)
            for message in outgoing:
                moved.by_queue[message.queue] = moved.by_queue.get(message.queue, 0) + 1
        if not include_taken:
            with source.connect() as conn:
                moved.taken_left = old.taken(conn, queues)
    finally:
        if source is not target:
            source.dispose()
    return moved


@dataclass(frozen=True)
class _OldTables:
    """kombu's SQLAlchemy broker tables (names as its transport options give them)."""

    queues: str
    messages: str

    def __post_init__(self) -> None:
        for name in (self.queues, self.messages):
            if not _TABLE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a table name (letters, digits and _, not starting with a digit)")

    def waiting(self, conn: Connection, after: int, names: Sequence[str], include_taken: bool,
                limit: int) -> list[Any]:
        query = (f"SELECT m.id AS id, q.name AS queue, m.payload AS payload FROM {self.messages} m "
                 f"JOIN {self.queues} q ON q.id = m.queue_id WHERE m.id > :after"
                 + ("" if include_taken else " AND m.visible = :visible"))
        statement, params = _of_queues(query, names, " ORDER BY m.id LIMIT :limit")
        return list(conn.execute(statement, {**params, "after": after, "limit": limit, "visible": True}))

    def delete(self, conn: Connection, ids: Sequence[int]) -> None:
        if ids:
            conn.execute(sa.text(f"DELETE FROM {self.messages} WHERE id IN :ids")
                         .bindparams(sa.bindparam("ids", expanding=True)), {"ids": list(ids)})

    def taken(self, conn: Connection, names: Sequence[str]) -> int:
        statement, params = _of_queues(f"SELECT count(*) FROM {self.messages} m JOIN {self.queues} q "
                                       "ON q.id = m.queue_id WHERE m.visible = :visible", names)
        return int(conn.execute(statement, {**params, "visible": False}).scalar() or 0)


def _of_queues(query: str, names: Sequence[str], tail: str = "") -> tuple[sa.TextClause, dict[str, Any]]:
    """``query`` narrowed to the queues ``names`` (all when empty), the names a bound parameter."""
    if not names:
        return sa.text(query + tail), {}
    statement = sa.text(query + " AND q.name IN :names" + tail).bindparams(sa.bindparam("names", expanding=True))
    return statement, {"names": list(names)}
