"""Operator actions on durable runs: read one, requeue a dead (or stranded) one with its completed steps kept,
cancel one that has not settled."""

from __future__ import annotations

from typing import Any

from celery_durable.errors import RunNotDead, RunNotFound, RunSettled
from celery_durable.store import runs as store_runs
from celery_durable.store.clock import store_now
from celery_durable.store.engine import ensure_schema, store_url, unavailable_as_error
from celery_durable.store.json_values import from_json
from celery_durable.store.runs import Run


def _app(app: Any) -> Any:
    if app is None:
        from celery import current_app

        return current_app
    return app


def _found(conn: Any, run_id: str) -> Run:
    run = store_runs.get(conn, run_id)
    if run is None:
        raise RunNotFound(f"no durable run has id {run_id!r}")
    return run


def get(run_id: str, *, app: Any = None) -> Run:
    url = store_url(_app(app))
    with unavailable_as_error(url), ensure_schema(url).connect() as conn:
        return _found(conn, run_id)


def requeue(run_id: str, *, app: Any = None) -> Run:
    """Send a dead run again (same id, args and queue; a fresh retry budget); its steps are kept.

    A run stranded ``running`` whose lease expired (its worker died and no
    message of it is left, e.g. purged from the broker) is taken too; one
    whose attempt is alive, or that has not settled otherwise, is refused.

    The run is reopened and the message published inside one transaction that
    holds the run's row: a worker that gets the message at once waits for the
    commit instead of seeing the run still dead; a failed publish leaves it dead.

    Under ``task_always_eager`` the run is executed here, after the reopen
    commits (executing it inside that transaction would wait on its own row
    lock), and the run is returned as that execution left it.
    """
    app = _app(app)
    url = store_url(app)
    engine = ensure_schema(url)
    eager = bool(app.conf.task_always_eager)
    with unavailable_as_error(url), engine.begin() as conn:
        run = _found(conn, run_id)
        if not store_runs.reopen(conn, run_id, store_now(conn)):
            held = " under a live lease" if run.lease_live(store_now(conn)) else ""
            raise RunNotDead(f"run {run_id} is {run.state}{held}; only a dead run, or one left running "
                             f"under an expired lease, can be requeued")
        if not eager:
            send(app, run)
            return store_runs.get(conn, run_id) or run
    send(app, run)
    with unavailable_as_error(url), engine.connect() as conn:
        return store_runs.get(conn, run_id) or run


def cancel(run_id: str, *, app: Any = None, reason: str = "cancelled by an operator") -> Run:
    """Settle a run cancelled in the store, then revoke it across the fleet (a running attempt is told).

    Raises RunNotFound for an unknown id and RunSettled for a run that has
    settled (succeeded, dead, cancelled).
    """
    app = _app(app)
    url = store_url(app)
    with unavailable_as_error(url), ensure_schema(url).begin() as conn:
        run = _found(conn, run_id)
        if run.settled:
            raise RunSettled(f"run {run_id} is {run.state} already; a settled run cannot be cancelled")
        store_runs.cancel(conn, run_id=run.id, task_name=run.task_name, queue=run.queue, args=run.args,
                          kwargs=run.kwargs, reason=reason)
    app.control.revoke(run_id)
    return run


def send(app: Any, run: Run, **options: Any) -> None:
    """Publish ``run`` again under its id, arguments and queue (``options``: more ``apply_async`` options)."""
    options["task_id"] = run.id
    if run.queue:
        options["queue"] = run.queue
    args, kwargs = from_json(run.args), from_json(run.kwargs)
    task = app.tasks.get(run.task_name)
    if task is not None:
        task.apply_async(args, kwargs, **options)
    else:
        app.send_task(run.task_name, args, kwargs, **options)
