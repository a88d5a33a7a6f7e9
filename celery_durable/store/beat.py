"""SQL for the durable beat: the leader lease, entry watermarks, fired ticks.

One replica of a beat leads at a time: it holds the beat's row in
``durable_beat_leader`` until ``expires_at`` and renews it each round. A
replica takes the row over only once it has expired, and doing so raises the
*term*. A fire's transaction first locks that row and checks the holder and
term are still this replica's and the lease still live (``still_leads``): a
leader paused past its TTL, whose lease another replica took, fires nothing —
its transaction finds the new holder, or waits behind the takeover and then
finds it.

A fire is the tick's row (unique per beat, entry and tick), the entry's new
watermark and the task's outbox row, all in the caller's one transaction: the
tick is fired and will be published, or it is not fired and the next leader
fires it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_durable.store.schema import beat_entries as entries
from celery_durable.store.schema import beat_fires as fires
from celery_durable.store.schema import beat_leader as leader

#: A released lease expires at this instant: any replica may take it at once.
RELEASED = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class EntryState:
    watermark: datetime
    paused: bool
    last_fire_at: datetime | None
    last_tick: datetime | None


@dataclass(frozen=True)
class Leadership:
    """Who leads a beat, as stored."""

    holder: str
    term: int
    expires_at: datetime


def lead(conn: Connection, beat: str, holder: str, ttl: float, now: datetime) -> int | None:
    """Take ``beat``'s lease (when free or expired) or renew it (when ``holder``'s); in the caller's
    transaction. Returns the term ``holder`` leads under, or None when another replica leads."""
    _insert_ignoring_conflict(conn, leader, dict(beat=beat, holder=holder, term=0, expires_at=RELEASED))
    current = _locked_leader(conn, beat)
    assert current is not None  # inserted above, or there already
    expires = now + timedelta(seconds=ttl)
    if current.holder == holder and current.expires_at >= now:
        conn.execute(leader.update().where(leader.c.beat == beat).values(expires_at=expires))
        return current.term
    if current.expires_at >= now:
        return None
    # Free: released, expired, or never held (and this replica's own lapsed lease too: a new
    # term, since another may have held it meanwhile and lapsed in turn).
    term = current.term + 1
    conn.execute(leader.update().where(leader.c.beat == beat).values(holder=holder, term=term, expires_at=expires))
    return term


def still_leads(conn: Connection, beat: str, holder: str, term: int, now: datetime) -> bool:
    """In a fire's transaction: lock the lease row and check ``holder`` leads under ``term`` now."""
    current = _locked_leader(conn, beat)
    return current is not None and (current.holder, current.term) == (holder, term) and current.expires_at >= now


def release(conn: Connection, beat: str, holder: str) -> bool:
    """Give the lease up (a replica stopping): a standby takes it at its next round."""
    result = conn.execute(leader.update().where(leader.c.beat == beat, leader.c.holder == holder)
                          .values(expires_at=RELEASED))
    return bool(result.rowcount)


def leadership(conn: Connection, beat: str) -> Leadership | None:
    row = conn.execute(sa.select(leader.c.holder, leader.c.term, leader.c.expires_at)
                       .where(leader.c.beat == beat)).first()
    return None if row is None else Leadership(row[0], int(row[1]), row[2])


def entry_states(conn: Connection, beat: str) -> dict[str, EntryState]:
    rows = conn.execute(sa.select(entries.c.entry, entries.c.watermark, entries.c.paused, entries.c.last_fire_at,
                                  entries.c.last_tick).where(entries.c.beat == beat))
    return {entry: EntryState(watermark, bool(paused), fired, tick)
            for entry, watermark, paused, fired, tick in rows}


def add_entry(conn: Connection, beat: str, entry: str, watermark: datetime) -> None:
    """Start tracking ``entry`` from ``watermark`` (nothing before it is due); kept if already there."""
    _insert_ignoring_conflict(conn, entries, dict(beat=beat, entry=entry, watermark=watermark, paused=False))


def fire(conn: Connection, beat: str, entry: str, tick: datetime, watermark: datetime, task_id: str, term: int,
         now: datetime) -> bool:
    """Record ``tick`` as fired and move the watermark, in the caller's transaction (which also
    holds the task's outbox row). False when the tick was fired already: send nothing."""
    inserted = _insert_ignoring_conflict(conn, fires, dict(beat=beat, entry=entry, tick=tick, task_id=task_id,
                                                           term=term, fired_at=now))
    if not inserted:
        return False
    conn.execute(entries.update().where(entries.c.beat == beat, entries.c.entry == entry)
                 .values(watermark=sa.case((entries.c.watermark < watermark, watermark), else_=entries.c.watermark),
                         last_fire_at=now, last_tick=tick))
    return True


def advance(conn: Connection, beat: str, entry: str, watermark: datetime) -> None:
    """Move the watermark past occurrences decided without a send (a catch-up policy passed them over)."""
    conn.execute(entries.update().where(entries.c.beat == beat, entries.c.entry == entry,
                                        entries.c.watermark < watermark).values(watermark=watermark))


def set_paused(conn: Connection, beat: str, entry: str, paused: bool, now: datetime) -> None:
    """Pause ``entry``, or resume it from ``now``: the ticks that fell due while it was paused are not
    sent (a pause is not an outage to catch up on). An entry not tracked yet starts tracked at ``now``."""
    add_entry(conn, beat, entry, now)
    values: dict[str, Any] = {"paused": paused}
    if not paused:
        values["watermark"] = sa.case((entries.c.watermark < now, now), else_=entries.c.watermark)
    conn.execute(entries.update().where(entries.c.beat == beat, entries.c.entry == entry).values(**values))


def fired(conn: Connection, beat: str, entry: str | None = None) -> list[tuple[str, datetime, str, int]]:
    """Fired ticks, oldest first: (entry, tick, task id, term)."""
    query = sa.select(fires.c.entry, fires.c.tick, fires.c.task_id, fires.c.term).where(fires.c.beat == beat)
    if entry is not None:
        query = query.where(fires.c.entry == entry)
    return [(e, t, task_id, int(term)) for e, t, task_id, term in
            conn.execute(query.order_by(fires.c.tick, fires.c.entry))]


def prune_fires(conn: Connection, older_than: datetime) -> int:
    """Forget fired ticks older than ``older_than`` (the watermark keeps their entries past them)."""
    return int(conn.execute(fires.delete().where(fires.c.fired_at < older_than)).rowcount or 0)


def _locked_leader(conn: Connection, beat: str) -> Leadership | None:
    query = sa.select(leader.c.holder, leader.c.term, leader.c.expires_at).where(leader.c.beat == beat)
    if conn.dialect.name == "postgresql":
        query = query.with_for_update()  # SQLite: BEGIN IMMEDIATE already admits one writer
    row = conn.execute(query).first()
    return None if row is None else Leadership(row[0], int(row[1]), row[2])


def _insert_ignoring_conflict(conn: Connection, table: sa.Table, values: dict[str, Any]) -> bool:
    """INSERT ... ON CONFLICT DO NOTHING; True if the row went in."""
    from sqlalchemy.dialects import postgresql, sqlite

    statement = (postgresql.insert(table) if conn.dialect.name == "postgresql" else sqlite.insert(table))
    return bool(conn.execute(statement.values(**values).on_conflict_do_nothing()).rowcount)
