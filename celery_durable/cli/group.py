"""The ``celery durable`` command group, and what its commands share (also what registers ``-P durable``)."""

from __future__ import annotations

from typing import Any

import click
from celery.bin.base import handle_preload_options

from celery_durable.errors import ConfigInvalid
from celery_durable.worker.boot import register

# Imported through the ``celery.commands`` entry point before Celery parses
# ``-P``: registering here makes ``-P durable`` work for an app module that
# never imports celery_durable.
register()


@click.group(name="durable")
@click.pass_context
# celery.bin.base ships no annotations: handle_preload_options is an untyped decorator.
@handle_preload_options  # type: ignore[untyped-decorator]
def durable(ctx: click.Context) -> None:
    """celery_durable operator commands."""


def store_url_of(app: Any) -> str:
    """The app's store URL, or one line naming ``durable_database_url`` when it does not parse."""
    from celery_durable.config import database_url
    from celery_durable.store.engine import store_url

    given = app.conf.get("durable_database_url")
    try:
        if given is not None:
            database_url(given)
    except ConfigInvalid as err:
        raise click.ClickException(str(err)) from None
    return store_url(app)
