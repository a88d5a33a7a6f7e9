"""``celery durable``: the operator command group (also what registers ``-P durable`` for any app)."""

from __future__ import annotations

import json

import click
from celery.bin.base import CeleryCommand, handle_preload_options

from .config import from_celery_conf
from .errors import ConfigInvalid
from .worker.boot import register

# Imported through the ``celery.commands`` entry point before Celery parses
# ``-P``: registering here makes ``-P durable`` work for an app module that
# never imports celery_durable.
register()


@click.group(name="durable")
@click.pass_context
@handle_preload_options
def durable(ctx: click.Context) -> None:
    """celery_durable operator commands."""


@durable.command(cls=CeleryCommand, name="config")
@click.pass_context
def show_config(ctx: click.Context) -> None:
    """Validate the app's durable_* settings and print them."""
    app = ctx.obj.app
    try:
        config = from_celery_conf(app.conf)
    except ConfigInvalid as err:
        raise click.ClickException(str(err)) from None
    click.echo(json.dumps({k: v for k, v in config.__dict__.items()}, default=str, indent=2))


@durable.command(cls=CeleryCommand, name="migrate")
@click.pass_context
def migrate_store(ctx: click.Context) -> None:
    """Upgrade the durable store (durable_database_url) to this version's schema."""
    from .errors import DurableError
    from .store.engine import migrate, resolve_url

    url = resolve_url(ctx.obj.app.conf.get("durable_database_url"))
    try:
        before, after = migrate(url)
    except DurableError as err:
        raise click.ClickException(str(err)) from None
    if before == after:
        click.echo(f"durable store already at {after}")
    else:
        click.echo(f"durable store migrated: {before or 'empty'} -> {after}")
