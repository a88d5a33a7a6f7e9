"""What the pytest plugin's ``durable_run`` returns: a durable run and its steps as the store holds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepRecord:
    name: str
    #: How many steps of the same name ran before it in the run (0 for the first).
    occurrence: int
    result: Any


@dataclass(frozen=True)
class RunRecord:
    id: str
    task_name: str
    state: str
    attempts: int
    result: Any
    last_error: str | None
    #: The run's completed steps, in the order they were checkpointed.
    steps: list[StepRecord]


def read_run(url: str, task_id: str) -> RunRecord | None:
    """The run ``task_id`` as the store at ``url`` holds it, or None if it has none."""
    from celery_durable.store import runs as store_runs
    from celery_durable.store import steps as store_steps
    from celery_durable.store.engine import ensure_schema
    from celery_durable.store.json_values import from_json

    engine = ensure_schema(url)
    with engine.connect() as conn:
        run = store_runs.get(conn, task_id)
        if run is None:
            return None
        stored = store_steps.load(conn, task_id)
    steps = [StepRecord(key.name, key.occurrence, from_json(encoded)) for key, encoded in stored.items()]
    return RunRecord(id=run.id, task_name=run.task_name, state=run.state, attempts=run.attempts,
                     result=from_json(run.result), last_error=run.last_error, steps=steps)
