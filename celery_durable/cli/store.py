"""``celery durable config|migrate|relay|limits``: the store, the relay, and the fleet limits."""

from __future__ import annotations

import json
from typing import Any

import click
from celery.bin.base import CeleryCommand

from celery_durable.cli.group import durable, store_url_of
from celery_durable.cli.options import OptionRefused
from celery_durable.config import from_celery_conf
from celery_durable.errors import ConfigInvalid
from celery_durable.worker.cli_options import naming_the_option


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
    from celery_durable.errors import DurableError
    from celery_durable.store.engine import migrate

    url = store_url_of(ctx.obj.app)
    try:
        before, after = migrate(url)
    except DurableError as err:
        raise click.ClickException(str(err)) from None
    if before == after:
        click.echo(f"durable store already at {after}")
    else:
        click.echo(f"durable store migrated: {before or 'empty'} -> {after}")


#: The settings ``durable relay``'s options override.
_RELAY_FLAGS = {"durable_relay_batch_size": "--batch-size", "durable_relay_poll_interval": "--poll-interval"}


@durable.command(cls=CeleryCommand, name="relay")
@click.option("--batch-size", type=int, default=None, help="rows per publish batch (durable_relay_batch_size)")
@click.option("--poll-interval", type=float, default=None,
              help="seconds between polls without a notification (durable_relay_poll_interval)")
@click.pass_context
def relay(ctx: click.Context, batch_size: int | None, poll_interval: float | None) -> None:
    """Publish committed outbox rows until SIGTERM/SIGINT (besides the relay in each -P durable worker)."""
    import logging
    import signal

    from celery_durable import faults
    from celery_durable.metrics.registry import serve
    from celery_durable.outbox.relay import Relay
    from celery_durable.store.urls import shown_url

    app = ctx.obj.app
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s] %(name)s: %(message)s")
    given = {"durable_relay_batch_size": batch_size, "durable_relay_poll_interval": poll_interval}
    overrides = {setting: value for setting, value in given.items() if value is not None}
    try:
        config = from_celery_conf(app.conf, overrides)
        if config.metrics_port is not None:
            serve(config.metrics_host, config.metrics_port)
    except ConfigInvalid as err:
        # An option given is named, not the setting it overrides: the option is what to fix, and
        # its refusal exits 2 like any bad option; a bad setting of the app's exits 1.
        if err.setting in _RELAY_FLAGS and err.setting in overrides:
            raise OptionRefused(str(naming_the_option(err, overrides, _RELAY_FLAGS))) from None
        raise click.ClickException(str(err)) from None
    runner = Relay(app, batch_size=config.relay_batch_size, poll_interval=config.relay_poll_interval,
                   retention=config.outbox_retention, faults=faults.of(app))
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: runner.stop())
    click.echo(f"durable relay: publishing the outbox of {shown_url(runner.url)}", err=True)
    runner.run()


@durable.command(cls=CeleryCommand, name="limits")
@click.option("--json", "as_json", is_flag=True, help="one JSON document instead of the table")
@click.pass_context
def limits(ctx: click.Context, as_json: bool) -> None:
    """Each fleet limit the app's tasks declare, the leases held now and the messages waiting."""
    from celery_durable.clock import SYSTEM_CLOCK
    from celery_durable.planning import limit_declarations
    from celery_durable.store import limit_waiting
    from celery_durable.store import limits as limit_store
    from celery_durable.store.engine import autocommit, engine_for, store_exists, unavailable_as_error

    app = ctx.obj.app
    app.loader.import_default_modules()
    try:
        declared = limit_declarations.of_app(app)
    except limit_declarations.LimitInvalid as err:
        raise click.ClickException(str(err)) from None
    url = store_url_of(app)
    holders: list[dict[str, Any]] = []
    waiting: list[tuple[str, str, str, int]] = []
    if store_exists(url):
        try:
            with unavailable_as_error(url), autocommit(engine_for(url)).connect() as conn:
                at = SYSTEM_CLOCK.now()
                holders = [h for h in limit_store.holders(conn, at) if h["kind"] != limit_store.RATE_KIND]
                waiting = limit_waiting.waiting_counts(conn)
        except Exception as err:  # noqa: BLE001 - one line naming the store, no traceback
            raise click.ClickException(str(err).splitlines()[0]) from None
    report: list[dict[str, Any]] = []
    for name, task_limits in declared.items():
        report.append({
            "task": name,
            "concurrency": task_limits.concurrency,
            "key_limit": task_limits.key_limit if task_limits.key is not None else None,
            "when_busy": task_limits.when_busy,
            "rate": (f"{task_limits.rate.count}/{int(task_limits.rate.period)}s"
                     if task_limits.rate is not None else None),
            "held": [{"key": h["key"] if h["kind"] == "key" else "*", "task_id": h["task_id"],
                      "holder": h["holder"] or "(booked for a waiting message)",
                      "expires_at": h["expires_at"].isoformat()} for h in holders if h["task_name"] == name],
            "waiting": sum(count for task, _, _, count in waiting if task == name),
        })
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    if not report:
        click.echo("no task of this app declares a fleet limit")
        return
    for entry in report:
        declared_parts = [f"{label}={entry[field]}" for field, label in
                          (("concurrency", "concurrency"), ("key_limit", "per key"), ("rate", "rate"))
                          if entry[field] is not None]
        click.echo(f"{entry['task']}: {', '.join(declared_parts)}, when busy: {entry['when_busy']}; "
                   f"{len(entry['held'])} held, {entry['waiting']} waiting")
        for held in entry["held"]:
            click.echo(f"  {held['key']:<24} {held['task_id']:<40} {held['holder']}")
