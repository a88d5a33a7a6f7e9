"""``celery durable broker``: the broker that claims rows — moving an ``sqla+`` broker's waiting messages into it.

Exit status: 0 moved (or nothing to move); 1 a database could not be read or written (named, one line);
2 bad input (the app's broker is not ``durable+…``, a source URL that is not ``sqla+…``, a bad table name).
"""

from __future__ import annotations

import json
from typing import Any

import click
from celery.bin.base import CeleryCommand

from celery_durable.cli.group import durable


@durable.group(name="broker")
def broker_group() -> None:
    """The broker that claims rows (durable+postgresql://, durable+sqlite:///)."""


@broker_group.command(cls=CeleryCommand, name="migrate-from-sqla")
@click.argument("source")
@click.option("--queue", "queues", multiple=True, help="Move only this queue's messages (repeat for more).")
@click.option("--include-taken", is_flag=True,
              help="Also move messages a consumer took and never acked (stop every old worker first: "
                   "their tasks may have run).")
@click.option("--queue-table", default="kombu_queue", show_default=True,
              help="The old transport's queue_tablename option.")
@click.option("--message-table", default="kombu_message", show_default=True,
              help="The old transport's message_tablename option.")
@click.option("--json", "as_json", is_flag=True, help="Print what was moved as JSON.")
@click.pass_context
def migrate_from_sqla(ctx: click.Context, source: str, queues: tuple[str, ...], include_taken: bool,
                      queue_table: str, message_table: str, as_json: bool) -> None:
    """Move the waiting messages of the sqla+ broker at SOURCE (e.g. sqla+sqlite:///broker.sqlite) into the
    app's broker (durable+…), oldest first, each queue's order kept."""
    import sqlalchemy as sa

    from celery_durable.broker.sqla_migration import migrate
    from celery_durable.errors import DurableError

    app = ctx.find_root().obj.app
    target = _durable_database(app)
    if not source.startswith("sqla+"):
        raise click.BadParameter(f"{source!r} is not an sqla+ broker URL (e.g. sqla+sqlite:///broker.sqlite)",
                                 param_hint="SOURCE")
    source_url = source.removeprefix("sqla+")
    try:
        moved = migrate(source_url, target, queues=queues, include_taken=include_taken,
                        queue_table=queue_table, message_table=message_table)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--queue-table/--message-table") from None
    except DurableError as err:  # the new broker's database: unreachable, or behind the code's schema
        raise click.ClickException(str(err).splitlines()[0]) from None
    except sa.exc.SQLAlchemyError as err:  # either database: unreachable, no such table (not an sqla+ broker)
        detail = str(getattr(err, "orig", None) or err).strip().splitlines()[0]
        raise click.ClickException(f"could not move the messages: {detail}") from None
    if as_json:
        click.echo(json.dumps({"moved": moved.by_queue, "taken_left": moved.taken_left,
                               "unreadable": moved.unreadable}))
        return
    per_queue = ", ".join(f"{queue} {count}" for queue, count in sorted(moved.by_queue.items())) or "none"
    click.echo(f"moved {moved.total} messages ({per_queue})")
    if moved.taken_left:
        click.echo(f"left {moved.taken_left} taken by a consumer and never acked (their tasks may have run): "
                   "stop every old worker, then --include-taken moves them")
    if moved.unreadable:
        click.echo(f"left {moved.unreadable} that are not kombu messages in {message_table}")


def _durable_database(app: Any) -> str:
    """The database of the app's broker, which must be the broker that claims rows."""
    url = str(app.conf.broker_url or "")
    if not url.startswith("durable+"):
        raise click.BadParameter(f"the app's broker_url is {url.split('://')[0] or 'unset'}://…, not durable+…: "
                                 "set broker_url to the broker to move the messages into", param_hint="broker_url")
    return url.removeprefix("durable+")
