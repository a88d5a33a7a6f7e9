"""SQL for step checkpoints: load a run's checkpoints at once, store one in a single INSERT."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.planning.checkpoints import StepKey
from celery_durable.store.schema import steps

_insert = sa.insert(steps)


def load(conn: Connection, run_id: str) -> dict[StepKey, str]:
    """Every checkpoint of ``run_id``: a replayed step is then a dict lookup, not a query."""
    rows = conn.execute(
        sa.select(steps.c.name, steps.c.occurrence, steps.c.result).where(steps.c.run_id == run_id)
    )
    return {StepKey(name, occurrence): result for name, occurrence, result in rows}


def insert(conn: Connection, run_id: str, key: StepKey, encoded: str) -> None:
    """Store one checkpoint; on an autocommit connection this is one round trip."""
    conn.execute(_insert, {"run_id": run_id, "name": key.name, "occurrence": key.occurrence,
                           "result": encoded, "created_at": SYSTEM_CLOCK.now()})
