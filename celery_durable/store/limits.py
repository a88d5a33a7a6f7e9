"""SQL for fleet limits: take a run's leases (or park its message), release them, hand turns to waiters.

Every statement on one scope runs under that scope's lock, so two workers
never both see the last free lease: a transaction-scoped advisory lock on
PostgreSQL (taken in one sorted order, so two transactions cannot deadlock),
and on SQLite the store's BEGIN IMMEDIATE, which already admits one writer.

A lease is *live* until its ``expires_at``; its holder's heartbeat moves that
on. An expired lease (its worker died) is deleted by the next statement that
locks its scope. A waiting message is made ready in arrival order when its
scope has room: a lease is booked for it (holder NULL) and its row is given a
``publish_at``; a worker's limit dispatcher publishes it, and the copy that
comes back takes the booked lease.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_durable.headers import LIMITS_CHANNEL
from celery_durable.planning.limit_declarations import Rate, Scope
from celery_durable.planning.limits import Decision, LimitAsk, RunRoom, ScopeState, plan_batch, return_rate_turn
from celery_durable.store import limit_declarations as declarations
from celery_durable.store import limit_waiting
from celery_durable.store.limit_waiting import WaitingMessage
from celery_durable.store.schema import limit_leases as leases
from celery_durable.store.schema import rate_limits

#: The kind of a lease row that books a rate turn for a waiting message.
RATE_KIND = "rate"


@dataclass(frozen=True)
class Return:
    """A run's leases going back: its scopes, and its rate turn if it never started."""

    task: str
    task_id: str
    scopes: tuple[Scope, ...]
    give_back_turn: Rate | None = None


def take_batch(conn: Connection, asks: Sequence[LimitAsk], messages: Sequence[WaitingMessage], *,
               holder: str, ttl: float, now: datetime, room: RunRoom | None = None) -> tuple[list[Decision], int]:
    """In ``conn``'s transaction: for each ask in order, take its leases, or park (or drop) its message.

    Returns each ask's decision, and how many waiting messages the batch made
    ready (a dispatcher should look now). A message that could run once
    ``room`` is spent is BACK: nothing is written for it.

    One transaction and a few statements per scope for the whole batch (a claim
    pass): the scopes are read once under their locks, the decisions are made
    in memory (``planning.limits.plan_batch``), and the writes go in bulk.
    """
    scopes = sorted({scope for ask in asks for scope in ask.scopes}, key=_scope_order)
    rated = sorted({ask.task for ask in asks if ask.rate is not None})
    _lock(conn, [_scope_lock(s.task, s.kind, s.key) for s in scopes] + [_scope_lock(t, RATE_KIND, "") for t in rated])
    task_ids = [ask.task_id for ask in asks]
    # Ids with a row already: parked (publish_at NULL: this is another copy of it), or
    # made ready and not yet published (its row will publish it: nothing more to park).
    already = limit_waiting.rows_of(conn, task_ids)
    parked_ids = {task_id for task_id, publish_at in already.items() if publish_at is None}
    states = {scope: _read_scope(conn, scope, now) for scope in scopes}
    rate_booked: set[tuple[str, str]] = set()
    tats: dict[str, datetime | None] = {}
    if rated:
        rate_booked = {(t, tid) for t, tid in conn.execute(
            sa.select(leases.c.task_name, leases.c.task_id).where(
                leases.c.task_name.in_(rated), leases.c.kind == RATE_KIND, leases.c.task_id.in_(task_ids)))}
        tats = {task: tat for task, tat in conn.execute(
            sa.select(rate_limits.c.task_name, rate_limits.c.tat).where(rate_limits.c.task_name.in_(rated)))}
    plan = plan_batch(list(asks), states, parked_ids, rate_booked, tats, now, room)

    made_ready = sum(_make_ready(conn, scope, count, ttl, now) for scope, count in plan.ready.items())
    expires = now + timedelta(seconds=ttl)
    for scope, task_id, _ in (lease for lease in plan.leases if lease[2]):
        conn.execute(leases.update().where(*_in_scope(scope), leases.c.task_id == task_id)
                     .values(holder=holder, expires_at=expires))
    new_leases = [dict(task_name=scope.task, kind=scope.kind, key=scope.key, task_id=task_id, holder=holder,
                       expires_at=expires) for scope, task_id, booked in plan.leases if not booked]
    if new_leases:
        conn.execute(leases.insert(), new_leases)
    for task, task_id in plan.used_rate_bookings:
        conn.execute(leases.delete().where(leases.c.task_name == task, leases.c.kind == RATE_KIND,
                                           leases.c.key == "", leases.c.task_id == task_id))
    if plan.rate_bookings:
        conn.execute(leases.insert(), [dict(task_name=task, kind=RATE_KIND, key="", task_id=task_id, holder=None,
                                            expires_at=start_at + timedelta(seconds=ttl))
                                       for task, task_id, start_at in plan.rate_bookings])
    for task, tat in plan.tats.items():
        _set_tat(conn, task, tat)
    rows = {messages[index].task_id: _parked_row(asks[index], scope, messages[index], now, publish_at)
            for index, scope, publish_at in plan.parked}
    for task_id in [task_id for task_id in rows if task_id in already]:
        # Its row was made ready and may be on its way out (a dispatcher publishing
        # it, about to delete it): the row waits again, in its first place. If a
        # dispatcher holds it, this waits for its commit and finds it gone (0 rows).
        if limit_waiting.wait_again(conn, rows[task_id]):
            del rows[task_id]
    if rows:
        limit_waiting.park(conn, list(rows.values()))
    if made_ready:
        _notify(conn)
    return plan.decisions, made_ready


def exchange(conn: Connection, returns: Sequence[Return], asks: Sequence[LimitAsk], *, holder: str, ttl: float,
             now: datetime) -> tuple[bool, bool]:
    """PostgreSQL, one statement: give back ``returns``' leases, then take the leases of every ask
    if each scope has room for them all and nobody waits there.

    Returns (taken, waiters). taken: every ask's run goes on (what
    ``take_batch`` decides for them then); false: none of their leases is
    taken, and ``take_batch`` decides (a busy scope, waiters who go first, a
    copy of a run it knows). waiters: a scope a lease went back to has
    messages waiting; ``release`` makes them ready. ``conn`` is in autocommit:
    the function is the transaction. Not for rate turns (``take_batch`` and
    ``release`` keep them), nor for two copies of one run in ``asks``.
    """
    if any(ask.rate is not None or not ask.scopes for ask in asks):
        raise ValueError("exchange takes leases for runs limited by scopes only")
    if any(ret.give_back_turn is not None for ret in returns):
        raise ValueError("exchange gives back leases, not rate turns")
    if len({ask.task_id for ask in asks}) != len(asks):
        raise ValueError("exchange takes one copy of a run")
    given_back = [(ret.task_id, scope) for ret in returns for scope in ret.scopes]
    wanted = [(ask.task_id, scope) for ask in asks for scope in ask.scopes]
    row = conn.exec_driver_sql(
        "SELECT taken, waiters FROM durable_limit_exchange(%(holder)s, %(locks)s, %(ret_ids)s, %(ret_tasks)s, "
        "%(ret_kinds)s, %(ret_keys)s, %(task_ids)s, %(tasks)s, %(kinds)s, %(keys)s, %(limits)s, %(now)s, "
        "%(expires)s)",
        dict(holder=holder,
             locks=sorted({_scope_lock(s.task, s.kind, s.key) for _, s in given_back + wanted}),
             ret_ids=[task_id for task_id, _ in given_back], ret_tasks=[s.task for _, s in given_back],
             ret_kinds=[s.kind for _, s in given_back], ret_keys=[s.key for _, s in given_back],
             task_ids=[task_id for task_id, _ in wanted], tasks=[s.task for _, s in wanted],
             kinds=[s.kind for _, s in wanted], keys=[s.key for _, s in wanted],
             limits=[s.limit for _, s in wanted], now=now, expires=now + timedelta(seconds=ttl))).one()
    return bool(row[0]), bool(row[1])


def release(conn: Connection, returns: Sequence[Return], *, holder: str, ttl: float, now: datetime) -> int:
    """Drop the runs' leases (and the rate turns of runs that never started); make waiters ready.

    One transaction for every return given (returns the store refused are
    tried again together). Returns how many waiters were made ready.
    """
    scopes = sorted({scope for ret in returns for scope in ret.scopes}, key=_scope_order)
    turns = sorted({ret.task for ret in returns if ret.give_back_turn is not None})
    _lock(conn, [_scope_lock(s.task, s.kind, s.key) for s in scopes] + [_scope_lock(t, RATE_KIND, "") for t in turns])
    _drop_returned(conn, returns, holder)
    made_ready = sum(_room(conn, scope, ttl, now) for scope in scopes)
    if made_ready:
        _notify(conn)
    return made_ready


def _drop_returned(conn: Connection, returns: Sequence[Return], holder: str) -> None:
    for ret in returns:
        for scope in ret.scopes:
            conn.execute(leases.delete().where(*_in_scope(scope), leases.c.task_id == ret.task_id,
                                               leases.c.holder == holder))
        if ret.give_back_turn is not None:
            _give_back_turn(conn, ret.task, ret.give_back_turn)


def sweep(conn: Connection, limits: dict[tuple[str, str], int], ttl: float, now: datetime) -> int:
    """Reclaim expired leases and make waiters ready where there is room; returns how many were made ready.

    ``limits`` maps (task, kind) to the limit of its scopes: a scope of a task
    this worker does not know is left to a worker that does.
    """
    conn.execute(leases.delete().where(leases.c.expires_at < now))
    made_ready = 0
    for task, kind, key in limit_waiting.scopes_waited_on(conn):
        limit = limits.get((task, kind))
        if limit is None:
            continue
        scope = Scope(task, kind, key, limit)
        _lock(conn, [_scope_lock(task, kind, key)])
        made_ready += _room(conn, scope, ttl, now)
    if made_ready:
        _notify(conn)
    return made_ready


def renew(conn: Connection, holder: str, ttl: float, now: datetime) -> int:
    """Extend every lease ``holder`` holds, and its declarations, by ``ttl`` from ``now``; returns how many leases."""
    declarations.renew(conn, holder, ttl, now)
    expires = now + timedelta(seconds=ttl)
    result = conn.execute(leases.update().where(leases.c.holder == holder).values(expires_at=expires))
    return int(result.rowcount or 0)


def release_holder(conn: Connection, holder: str) -> int:
    """Drop every lease ``holder`` still holds, and its declarations (a worker on its way out); returns how many
    leases."""
    declarations.withdraw(conn, holder)
    return int(conn.execute(leases.delete().where(leases.c.holder == holder)).rowcount or 0)


def held(conn: Connection, now: datetime) -> list[tuple[str, str, str, int]]:
    """Live leases per scope: (task, kind, key, count), rate bookings left out."""
    rows = conn.execute(sa.select(leases.c.task_name, leases.c.kind, leases.c.key, sa.func.count())
                        .where(leases.c.expires_at >= now, leases.c.kind != RATE_KIND)
                        .group_by(leases.c.task_name, leases.c.kind, leases.c.key)).all()
    return [(t, k, key, int(n)) for t, k, key, n in rows]


def holders(conn: Connection, now: datetime) -> list[dict[str, Any]]:
    """Every live lease, for the operator's view."""
    rows = conn.execute(sa.select(leases).where(leases.c.expires_at >= now)
                        .order_by(leases.c.task_name, leases.c.kind, leases.c.key)).mappings().all()
    return [dict(row) for row in rows]


# -- inside one scope's lock --------------------------------------------------------------------
def _read_scope(conn: Connection, scope: Scope, now: datetime) -> ScopeState:
    """The scope's live leases, and its waiters when it has room (a full scope never needs them).

    Leases whose holder died (expired) are deleted, only when there are some:
    one statement reads a full scope, which is what a flood of waiting messages meets.
    """
    rows = conn.execute(sa.select(leases.c.task_id, leases.c.holder, leases.c.expires_at)
                        .where(*_in_scope(scope))).all()
    live = [(tid, holder) for tid, holder, expires in rows if expires >= now]
    if len(live) < len(rows):
        conn.execute(leases.delete().where(*_in_scope(scope), leases.c.expires_at < now))
    lowest = declarations.lowest_declared(conn, scope, now)
    state = ScopeState(live=len(live), booked={tid for tid, holder in live if holder is None},
                       held={tid for tid, holder in live if holder is not None},
                       limit=lowest if lowest is not None and lowest < scope.limit else None)
    if len(live) < state.limit_of(scope):
        state.waiting = limit_waiting.waiting_on(conn, scope)
    return state


def _make_ready(conn: Connection, scope: Scope, count: int, ttl: float, now: datetime) -> int:
    """Book a lease for each of the ``count`` oldest waiters of ``scope`` and mark them due now."""
    if count <= 0:
        return 0
    queued = limit_waiting.oldest_waiting(conn, scope, count)
    if not queued:
        return 0
    expires = now + timedelta(seconds=ttl)
    conn.execute(leases.insert(), [dict(task_name=scope.task, kind=scope.kind, key=scope.key, task_id=waiter,
                                        holder=None, expires_at=expires) for _, waiter in queued])
    limit_waiting.mark_due(conn, [row_id for row_id, _ in queued], now)
    return len(queued)


def _room(conn: Connection, scope: Scope, ttl: float, now: datetime) -> int:
    """Make waiters ready while ``scope`` has room; returns how many."""
    state = _read_scope(conn, scope, now)
    return _make_ready(conn, scope, min(state.limit_of(scope) - state.live, state.waiting), ttl, now)


def _parked_row(ask: LimitAsk, scope: Scope | None, message: WaitingMessage, now: datetime,
                publish_at: datetime | None) -> dict[str, Any]:
    task, kind, key = (scope.task, scope.kind, scope.key) if scope is not None else (ask.task, RATE_KIND, "")
    return dict(task_name=task, kind=kind, key=key, task_id=message.task_id, queue=message.queue,
                exchange=message.exchange, routing_key=message.routing_key, body=message.body,
                headers=message.headers, properties=message.properties, content_type=message.content_type,
                content_encoding=message.content_encoding, created_at=now, publish_at=publish_at)


def _scope_order(scope: Scope) -> tuple[str, str, str]:
    return scope.task, scope.kind, scope.key


def _give_back_turn(conn: Connection, task: str, rate: Rate) -> None:
    tat = conn.execute(sa.select(rate_limits.c.tat).where(rate_limits.c.task_name == task)).scalar()
    if tat is not None:
        _set_tat(conn, task, return_rate_turn(tat, rate.interval))


def _set_tat(conn: Connection, task: str, tat: datetime) -> None:
    if not conn.execute(rate_limits.update().where(rate_limits.c.task_name == task).values(tat=tat)).rowcount:
        conn.execute(rate_limits.insert().values(task_name=task, tat=tat))


def _in_scope(scope: Scope) -> tuple[Any, ...]:
    return (leases.c.task_name == scope.task, leases.c.kind == scope.kind, leases.c.key == scope.key)


def _scope_lock(task: str, kind: str, key: str) -> str:
    return f"durable_limit\x1f{task}\x1f{kind}\x1f{key}"


def _lock(conn: Connection, names: list[str]) -> None:
    if conn.dialect.name != "postgresql" or not names:
        return  # SQLite: BEGIN IMMEDIATE holds the only write lock
    # One statement, the locks taken left to right in one sorted order (no two
    # transactions can wait on each other's).
    ordered = sorted(set(names))
    calls = ", ".join(f"pg_advisory_xact_lock(hashtextextended(:n{i}, 0))" for i in range(len(ordered)))
    conn.execute(sa.text(f"SELECT {calls}"), {f"n{i}": name for i, name in enumerate(ordered)})


def _notify(conn: Connection) -> None:
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"NOTIFY {LIMITS_CHANNEL}")
