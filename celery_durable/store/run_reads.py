"""What operators and gauges read of the runs: listings, counts per state and per queue, a run's steps.

``celery durable runs``/``status``, the dashboard and the queue gauges read these; none of them takes
a lease or writes. The runs' own lifecycle SQL is store/runs.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_durable.store.runs import Run
from celery_durable.store.schema import DEAD, INDEXED_STATES, SUCCEEDED, by_state, runs, steps


def listed(conn: Connection, *, states: Sequence[str] = (), task: str | None = None,
           since: datetime | None = None, limit: int = 50) -> list[Run]:
    """Runs, most recently updated first, filtered by state, task name and last update.

    Succeeded runs are not in the state index: a listing that asks for them reads the table, as an
    unfiltered listing does.
    """
    query = sa.select(runs)
    if states:
        query = query.where(*by_state(states))
    if task is not None:
        query = query.where(runs.c.task_name == task)
    if since is not None:
        query = query.where(runs.c.updated_at >= since)
    rows = conn.execute(query.order_by(runs.c.updated_at.desc(), runs.c.id).limit(limit))
    return [Run(**row._mapping) for row in rows]


def count_by_state(conn: Connection) -> dict[str, int]:
    """Runs in the store per state.

    The state index leaves out succeeded runs: they are counted as every run less the others, in one
    statement (one snapshot), from the index of the others and the smallest index of all runs.
    """
    others = sa.select(runs.c.state, sa.func.count()).where(INDEXED_STATES).group_by(runs.c.state)
    every = sa.select(sa.literal(None, sa.String), sa.func.count()).select_from(runs)
    counts: dict[str, int] = {}
    total = 0
    for state, count in conn.execute(sa.union_all(others, every)):
        if state is None:
            total = int(count)
        else:
            counts[state] = int(count)
    succeeded = total - sum(counts.values())
    return {**counts, SUCCEEDED: succeeded} if succeeded else counts


def dead_by_queue(conn: Connection) -> dict[str, int]:
    """Dead runs per queue they were claimed from ("" for a run whose queue is not known)."""
    rows = conn.execute(sa.select(runs.c.queue, sa.func.count()).where(runs.c.state == DEAD, INDEXED_STATES)
                        .group_by(runs.c.queue))
    return {queue or "": int(count) for queue, count in rows}


def steps_of(conn: Connection, run_id: str) -> list[tuple[str, int, int, datetime]]:
    """A run's checkpoints in the order they were taken: (name, occurrence, result size in bytes, taken at)."""
    rows = conn.execute(sa.select(steps.c.name, steps.c.occurrence, sa.func.length(steps.c.result),
                                  steps.c.created_at).where(steps.c.run_id == run_id)
                        .order_by(steps.c.created_at, steps.c.name, steps.c.occurrence))
    return [(name, int(occurrence), int(size or 0), taken) for name, occurrence, size, taken in rows]
