"""SQL for the limits each worker declares: live while its heartbeat renews them, the lowest applies fleet-wide."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_durable.planning.limit_declarations import Scope
from celery_durable.store.schema import limit_declarations as declarations


def declare(conn: Connection, holder: str, limits: dict[tuple[str, str], int], ttl: float,
            now: datetime) -> dict[tuple[str, str], tuple[int, int]]:
    """Record the limits ``holder`` declares per (task, kind), live for ``ttl`` (its heartbeat renews them).

    Returns, for each (task, kind) it declares, the lowest and highest limit
    live workers declare (itself included): where they differ, the lowest applies.
    """
    expires = now + timedelta(seconds=ttl)
    conn.execute(declarations.delete().where(declarations.c.holder == holder))
    if limits:
        conn.execute(declarations.insert(), [dict(task_name=task, kind=kind, holder=holder, limit_value=limit,
                                                  expires_at=expires) for (task, kind), limit in limits.items()])
    return declared_range(conn, list(limits), now)


def declared_range(conn: Connection, pairs: Sequence[tuple[str, str]],
                   now: datetime) -> dict[tuple[str, str], tuple[int, int]]:
    """The lowest and highest limit live workers declare for each (task, kind) of ``pairs`` that has one."""
    tasks = sorted({task for task, _ in pairs})
    if not tasks:
        return {}
    value = declarations.c.limit_value
    rows = conn.execute(sa.select(declarations.c.task_name, declarations.c.kind, sa.func.min(value), sa.func.max(value))
                        .where(declarations.c.task_name.in_(tasks), declarations.c.expires_at >= now)
                        .group_by(declarations.c.task_name, declarations.c.kind)).all()
    wanted = set(pairs)
    return {(task, kind): (int(low), int(high)) for task, kind, low, high in rows if (task, kind) in wanted}


def lowest_declared(conn: Connection, scope: Scope, now: datetime) -> int | None:
    """The lowest limit a live worker declares for ``scope``'s task and kind, if any does."""
    lowest = conn.execute(sa.select(sa.func.min(declarations.c.limit_value)).where(
        declarations.c.task_name == scope.task, declarations.c.kind == scope.kind,
        declarations.c.expires_at >= now)).scalar()
    return int(lowest) if lowest is not None else None


def renew(conn: Connection, holder: str, ttl: float, now: datetime) -> None:
    """Extend ``holder``'s declarations by ``ttl`` from ``now``."""
    conn.execute(declarations.update().where(declarations.c.holder == holder)
                 .values(expires_at=now + timedelta(seconds=ttl)))


def withdraw(conn: Connection, holder: str) -> None:
    """Drop ``holder``'s declarations (a worker on its way out)."""
    conn.execute(declarations.delete().where(declarations.c.holder == holder))
