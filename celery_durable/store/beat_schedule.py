"""SQL for the beat entries added at run time (``durable_beat_schedule``): read, insert, update, delete.

The rows are checked before they are written (``celery_durable.beat.stored_spec``); this module
only moves them. Removing an entry, and adding one, forgets the name's watermark and pause
(``durable_beat_entries``) in the same transaction, so an entry starts from its own first sight
instead of catching up on ticks of another of its name. Its sent ticks (``durable_beat_fires``) stay: the audit
trail of what was sent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_durable.store.schema import beat_entries as states
from celery_durable.store.schema import beat_schedule as table


@dataclass(frozen=True)
class StoredEntry:
    """One entry as stored: a task on a schedule of ``every`` seconds or a ``crontab`` line (one of them)."""

    name: str
    task: str
    every: float | None = None
    crontab: str | None = None
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)

    def as_config(self) -> dict[str, Any]:
        """The entry as a ``beat_schedule`` value (a crontab line is a schedule there too)."""
        return {"task": self.task, "schedule": self.every if self.every is not None else self.crontab,
                "args": list(self.args), "kwargs": dict(self.kwargs), "options": dict(self.options)}


def stored_entries(conn: Connection, beat: str) -> dict[str, StoredEntry]:
    """Every stored entry of ``beat``, by name."""
    rows = conn.execute(sa.select(table.c.entry, table.c.task, table.c.every, table.c.crontab, table.c.args,
                                  table.c.kwargs, table.c.options).where(table.c.beat == beat)
                        .order_by(table.c.entry))
    return {row[0]: _entry(*row) for row in rows}


def stored_entry(conn: Connection, beat: str, name: str) -> StoredEntry | None:
    """``name``'s row, locked until the caller's transaction ends (PostgreSQL; SQLite's BEGIN
    IMMEDIATE already admits one writer), so two edits of one entry apply one after the other."""
    query = sa.select(table.c.entry, table.c.task, table.c.every, table.c.crontab, table.c.args, table.c.kwargs,
                      table.c.options).where(table.c.beat == beat, table.c.entry == name)
    if conn.dialect.name == "postgresql":
        query = query.with_for_update()
    row = conn.execute(query).first()
    return None if row is None else _entry(*row)


def insert(conn: Connection, beat: str, entry: StoredEntry, now: datetime) -> bool:
    """Store a new entry; False (nothing written) when ``beat`` has one of that name already.

    A watermark already kept under the name is dropped: one a leader's round in flight wrote back
    after a remove (it had read the entry before), or one of a ``beat_schedule`` entry since taken
    out of the code. The new entry starts from its own first sight, not from their last tick."""
    from sqlalchemy.dialects import postgresql, sqlite

    statement = postgresql.insert(table) if conn.dialect.name == "postgresql" else sqlite.insert(table)
    result = conn.execute(statement.values(beat=beat, entry=entry.name, **_columns(entry), updated_at=now)
                          .on_conflict_do_nothing())
    if not result.rowcount:
        return False
    conn.execute(states.delete().where(states.c.beat == beat, states.c.entry == entry.name))
    return True


def update(conn: Connection, beat: str, entry: StoredEntry, now: datetime) -> bool:
    """Replace ``entry.name``'s row (its watermark is kept: the new schedule runs on from it)."""
    result = conn.execute(table.update().where(table.c.beat == beat, table.c.entry == entry.name)
                          .values(**_columns(entry), updated_at=now))
    return bool(result.rowcount)


def delete(conn: Connection, beat: str, name: str) -> bool:
    """Remove ``name`` and its watermark and pause; False when no such stored entry."""
    result = conn.execute(table.delete().where(table.c.beat == beat, table.c.entry == name))
    if not result.rowcount:
        return False
    conn.execute(states.delete().where(states.c.beat == beat, states.c.entry == name))
    return True


def _columns(entry: StoredEntry) -> dict[str, Any]:
    return dict(task=entry.task, every=entry.every, crontab=entry.crontab, args=json.dumps(list(entry.args)),
                kwargs=json.dumps(dict(entry.kwargs), sort_keys=True),
                options=json.dumps(dict(entry.options), sort_keys=True))


def _entry(name: str, task: str, every: float | None, crontab: str | None, args: str, kwargs: str,
           options: str) -> StoredEntry:
    return StoredEntry(name, task, None if every is None else float(every), crontab, tuple(json.loads(args)),
                       json.loads(kwargs), json.loads(options))
