"""``celery durable runs``: the durable runs in the store — list, show, requeue, cancel, purge.

Exit status: 0 done; 1 the store could not be read or written (named, one
line); 2 bad input (an unknown state, a duration that does not parse, a store
URL that does not parse); 3 no run has the id given, or the run is not in a
state the verb acts on (requeue a run that is not dead, cancel a settled one).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import click
from celery.bin.base import CeleryCommand
from sqlalchemy.engine import Connection

from celery_durable.cli.group import durable, store_url_of
from celery_durable.cli.options import count
from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.errors import DurableError
from celery_durable.store.schema import CANCELLED, DEAD, SETTLED, STATES, SUCCEEDED

#: Exit status of a verb that found no such run, or a run it cannot act on.
NOT_ACTED_ON = 3


class RunRefused(click.ClickException):
    exit_code = NOT_ACTED_ON


@durable.group(name="runs")
def runs_group() -> None:
    """Durable runs in the store: list, show, requeue, cancel, purge."""


def _duration(value: str | None, option: str) -> float | None:
    from celery_durable.planning.durations import DurationInvalid, parse_duration

    if value is None:
        return None
    try:
        return parse_duration(value)
    except DurationInvalid as err:
        raise click.BadParameter(str(err), param_hint=option) from None


@contextmanager
def _store(ctx: click.Context, *, write: bool = False) -> Iterator[tuple[Any, Connection]]:
    """(app, connection) on the app's store; a store that cannot be reached is one line, exit 1."""
    from celery_durable.store.engine import ensure_schema, unavailable_as_error

    app = ctx.find_root().obj.app
    url = store_url_of(app)
    try:
        with unavailable_as_error(url), ensure_schema(url).connect() as conn:
            if write:
                with conn.begin():
                    yield app, conn
            else:
                yield app, conn
    except DurableError as err:
        raise click.ClickException(str(err).splitlines()[0]) from None


def _run_row(run: Any) -> dict[str, Any]:
    return {"id": run.id, "task": run.task_name, "queue": run.queue, "state": run.state, "attempts": run.attempts,
            "started_at": run.started_at.isoformat(), "updated_at": run.updated_at.isoformat(),
            "finished_at": run.finished_at.isoformat() if run.finished_at else None, "last_error": run.last_error}


@runs_group.command(cls=CeleryCommand, name="list")
@click.option("--state", "states", multiple=True, type=click.Choice(STATES), help="only runs in this state")
@click.option("--task", default=None, help="only runs of this task name")
@click.option("--since", default=None, help="only runs updated within this long (30d, 12h, 90m)")
@click.option("--limit", default=50, show_default=True, type=count())
@click.option("--json", "as_json", is_flag=True, help="one JSON document instead of the table")
@click.pass_context
def runs_list(ctx: click.Context, states: tuple[str, ...], task: str | None, since: str | None, limit: int,
              as_json: bool) -> None:
    """Runs, most recently updated first."""
    from celery_durable.store import run_reads

    seconds = _duration(since, "--since")
    with _store(ctx) as (_, conn):
        after = SYSTEM_CLOCK.now() - timedelta(seconds=seconds) if seconds is not None else None
        found = run_reads.listed(conn, states=states, task=task, since=after, limit=limit)
    rows = [_run_row(run) for run in found]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for line in runs_table(rows):
        click.echo(line)
    if not rows:
        click.echo("no run matches", err=True)


def runs_table(rows: list[dict[str, Any]]) -> list[str]:
    """``runs list`` as a table: a header row, then a run a line (its last error's first line, cut, at the end)."""
    if not rows:
        return []
    lines = [f"{'ID':<38} {'STATE':<10} {'TASK':<32} {'ATTEMPTS':>8}  {'UPDATED':<32}  LAST ERROR"]
    for row in rows:
        error = row["last_error"].splitlines()[0][:80] if row["last_error"] else ""
        lines.append(f"{row['id']:<38} {row['state']:<10} {row['task']:<32} {row['attempts']:>8}  "
                     f"{row['updated_at']:<32}  {error}".rstrip())
    return lines


@runs_group.command(cls=CeleryCommand, name="show")
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="one JSON document instead of the text")
@click.pass_context
def runs_show(ctx: click.Context, run_id: str, as_json: bool) -> None:
    """One run: its state, arguments, outcome and each step (its result's size, when it was taken)."""
    from celery_durable.store import run_reads
    from celery_durable.store import runs as store_runs

    with _store(ctx) as (_, conn):
        run = store_runs.get(conn, run_id)
        steps = run_reads.steps_of(conn, run_id) if run is not None else []
    if run is None:
        raise RunRefused(f"no durable run has id {run_id!r}")
    shown = {**_run_row(run), "args": run.args, "kwargs": run.kwargs, "result": run.result,
             "steps": [{"name": name, "occurrence": occurrence, "result_bytes": size, "taken_at": taken.isoformat()}
                       for name, occurrence, size, taken in steps]}
    if as_json:
        click.echo(json.dumps(shown, indent=2))
        return
    for key in ("id", "task", "queue", "state", "attempts", "args", "kwargs", "started_at", "finished_at",
                "result", "last_error"):
        click.echo(f"{key:<12} {shown[key]}")
    for step in shown["steps"]:
        click.echo(f"  step {step['name']}#{step['occurrence']:<3} {step['result_bytes']:>8} bytes  "
                   f"{step['taken_at']}")


@runs_group.command(cls=CeleryCommand, name="requeue")
@click.argument("run_id", required=False)
@click.option("--all-dead", is_flag=True, help="every dead run (with --task: of that task)")
@click.option("--task", default=None, help="with --all-dead: only this task's dead runs")
@click.pass_context
def runs_requeue(ctx: click.Context, run_id: str | None, all_dead: bool, task: str | None) -> None:
    """Send a dead run again (same id, its completed steps kept), or every dead run."""
    from celery_durable.errors import RunNotDead, RunNotFound
    from celery_durable.store import run_reads
    from celery_durable.tasks import runs as run_actions

    if (run_id is None) == (not all_dead):
        raise click.UsageError("give a run id, or --all-dead (not both)")
    if task is not None and not all_dead:
        raise click.UsageError("--task goes with --all-dead")
    app = ctx.find_root().obj.app
    if all_dead:
        with _store(ctx) as (_, conn):
            ids = [run.id for run in run_reads.listed(conn, states=[DEAD], task=task, limit=1_000_000)]
    else:
        assert run_id is not None
        ids = [run_id]
    for each in ids:
        try:
            run_actions.requeue(each, app=app)
        except (RunNotFound, RunNotDead) as err:
            raise RunRefused(str(err)) from None
        except DurableError as err:
            raise click.ClickException(str(err).splitlines()[0]) from None
        click.echo(f"{each}: requeued")
    if all_dead and not ids:
        click.echo("no dead run" + (f" of {task}" if task else ""), err=True)


@runs_group.command(cls=CeleryCommand, name="cancel")
@click.argument("run_id")
@click.pass_context
def runs_cancel(ctx: click.Context, run_id: str) -> None:
    """Settle a run cancelled in the store, and revoke it across the fleet (a running attempt is told)."""
    from celery_durable.errors import RunNotFound, RunSettled
    from celery_durable.tasks import runs as run_actions

    app = ctx.find_root().obj.app
    store_url_of(app)  # a store URL that does not parse is named before anything is tried
    try:
        run_actions.cancel(run_id, app=app, reason="cancelled by an operator (celery durable runs cancel)")
    except (RunNotFound, RunSettled) as err:
        raise RunRefused(str(err)) from None
    except DurableError as err:
        raise click.ClickException(str(err).splitlines()[0]) from None
    click.echo(f"{run_id}: cancelled")


#: What ``runs purge`` deletes unless told: runs that ended and will never run again on their own.
PURGEABLE = (SUCCEEDED, CANCELLED)


@runs_group.command(cls=CeleryCommand, name="purge")
@click.option("--older-than", "older_than", required=True, help="runs finished longer ago than this (30d, 12h)")
@click.option("--include-dead", is_flag=True, help="dead runs too (kept unless asked: they may be requeued)")
@click.pass_context
def runs_purge(ctx: click.Context, older_than: str, include_dead: bool) -> None:
    """Delete settled runs (and their steps) that finished longer ago than --older-than."""
    from celery_durable.tasks.retention import purge_runs

    seconds = _duration(older_than, "--older-than")
    assert seconds is not None
    states = PURGEABLE + ((DEAD,) if include_dead else ())
    app = ctx.find_root().obj.app
    try:
        removed = purge_runs(store_url_of(app), seconds, states)
    except DurableError as err:
        raise click.ClickException(str(err).splitlines()[0]) from None
    click.echo(f"purged {removed} run(s) finished more than {older_than} ago "
               f"({', '.join(s for s in states if s in SETTLED)})")
