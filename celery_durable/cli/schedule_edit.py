"""``celery durable schedule add|edit|remove``: the beat's entries stored at run time, from the command line.

Each command calls ``celery_durable.beat.schedule_entries`` (the Python API), so the command line and
Python check and write alike. JSON fields (``--args``, ``--kwargs``, ``--options``) are JSON text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
from celery.bin.base import CeleryCommand

from celery_durable.cli.schedule import schedule


def _fields(add: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options of add and edit (edit: every one optional, a field not given is kept)."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed([
            click.option("--task", required=add, metavar="TASK",
                         help="the task's name (may be one only the workers import)"),
            click.option("--every", metavar="SECONDS", help="seconds between sends (replaces a crontab)"),
            click.option("--crontab", metavar="LINE",
                         help='a crontab line, "minute hour day-of-month month day-of-week" (replaces --every)'),
            click.option("--args", metavar="JSON", help="the task's positional arguments, a JSON list"),
            click.option("--kwargs", metavar="JSON", help="the task's keyword arguments, a JSON object"),
            click.option("--queue", metavar="QUEUE", help="the queue to send to"),
            click.option("--options", metavar="JSON",
                         help='apply_async options, a JSON object (and "durable_catch_up")'),
        ]):
            command = option(command)
        return command

    return decorate


@schedule.command(cls=CeleryCommand, name="add")
@click.argument("name")
@_fields(add=True)
@click.pass_context
def schedule_add(ctx: click.Context, /, name: str, **fields: Any) -> None:
    """Store a new entry NAME: --task on --every SECONDS or a --crontab line; the leader runs it from
    its next round. A name of the app's beat_schedule is refused."""
    from celery_durable.beat import schedule_entries

    app = _app(ctx)
    entry = _run(lambda: schedule_entries.add(app, name, **fields))
    _warn_unknown_task(app, entry.task)
    click.echo(f"{name}: added")


@schedule.command(cls=CeleryCommand, name="edit")
@click.argument("name")
@_fields(add=False)
@click.pass_context
def schedule_edit(ctx: click.Context, /, name: str, **fields: Any) -> None:
    """Change the fields given of the stored entry NAME (the others kept); the leader runs the change
    from its next round. The app's beat_schedule entries are read-only."""
    from celery_durable.beat import schedule_entries

    app = _app(ctx)
    entry = _run(lambda: schedule_entries.edit(app, name, **fields))
    _warn_unknown_task(app, entry.task)
    click.echo(f"{name}: edited")


@schedule.command(cls=CeleryCommand, name="remove")
@click.argument("name")
@click.pass_context
def schedule_remove(ctx: click.Context, name: str) -> None:
    """Delete the stored entry NAME: not sent again once the leader's round in progress ends."""
    from celery_durable.beat import schedule_entries

    app = _app(ctx)
    _run(lambda: schedule_entries.remove(app, name))
    click.echo(f"{name}: removed")


def _app(ctx: click.Context) -> Any:
    app = ctx.find_root().obj.app
    app.loader.import_default_modules()
    return app


def _run(call: Callable[[], Any]) -> Any:
    """``call``'s result; a refusal or a store that cannot be reached in one line, no traceback."""
    from celery_durable.errors import DurableError

    try:
        return call()
    except DurableError as err:
        raise click.ClickException(str(err)) from None
    except Exception as err:  # noqa: BLE001 - one line naming the store, no traceback
        raise click.ClickException(str(err).splitlines()[0]) from None


def _warn_unknown_task(app: Any, task: str) -> None:
    if task not in app.tasks:
        click.echo(f"note: task {task!r} is not registered in this app: it is sent by name, and a worker "
                   f"that does not know it rejects it", err=True)
