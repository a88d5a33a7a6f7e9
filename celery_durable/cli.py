"""``celery durable``: the operator command group (also what registers ``-P durable`` for any app)."""

from __future__ import annotations

import json
from typing import Any

import click
from celery.bin.base import CeleryCommand, handle_preload_options

from celery_durable.config import from_celery_conf
from celery_durable.errors import ConfigInvalid
from celery_durable.worker.boot import register
from celery_durable.worker.cli_options import naming_the_option

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

    url = _store_url(ctx.obj.app)
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
        # An option given is named, not the setting it overrides: the option is what to fix.
        named = naming_the_option(err, overrides, _RELAY_FLAGS)
        raise click.ClickException(str(named)) from None
    runner = Relay(app, batch_size=config.relay_batch_size, poll_interval=config.relay_poll_interval,
                   retention=config.outbox_retention, faults=faults.of(app))
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: runner.stop())
    click.echo(f"durable relay: publishing the outbox of {shown_url(runner.url)}", err=True)
    runner.run()


def _store_url(app: Any) -> str:
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


@durable.command(cls=CeleryCommand, name="limits")
@click.option("--json", "as_json", is_flag=True, help="one JSON document instead of the table")
@click.pass_context
def limits(ctx: click.Context, as_json: bool) -> None:
    """Each fleet limit the app's tasks declare, the leases held now and the messages waiting."""
    from celery_durable.planning import limit_declarations
    from celery_durable.store import limits as limit_store
    from celery_durable.store.engine import autocommit, engine_for, store_exists, unavailable_as_error
    from celery_durable.store.runs import now

    app = ctx.obj.app
    app.loader.import_default_modules()
    try:
        declared = limit_declarations.of_app(app)
    except limit_declarations.LimitInvalid as err:
        raise click.ClickException(str(err)) from None
    url = _store_url(app)
    holders: list[dict[str, Any]] = []
    waiting: list[tuple[str, str, str, int]] = []
    if store_exists(url):
        try:
            with unavailable_as_error(url), autocommit(engine_for(url)).connect() as conn:
                at = now()
                holders = [h for h in limit_store.holders(conn, at) if h["kind"] != limit_store.RATE_KIND]
                waiting = limit_store.waiting_counts(conn)
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


@durable.group(name="schedule")
def schedule() -> None:
    """The durable beat's schedule: list the entries, pause or resume one, send one now."""


def _beat_of(ctx: click.Context) -> tuple[Any, str, str, dict[str, Any]]:
    """(app, store url, beat name, entries): the app's beat_schedule, checked; one line when it is not."""
    from celery_durable.beat.entries import read_entries
    from celery_durable.errors import DurableError

    app = ctx.find_root().obj.app
    app.loader.import_default_modules()
    try:
        config = from_celery_conf(app.conf)
        entries = read_entries(app, app.conf.beat_schedule or {})
    except DurableError as err:
        raise click.ClickException(str(err)) from None
    return app, _store_url(app), config.beat_name or app.main or "celery", entries


def _entry_named(entries: dict[str, Any], name: str) -> Any:
    if name not in entries:
        known = ", ".join(sorted(entries)) or "none"
        raise click.ClickException(f"no beat_schedule entry named {name!r} (entries: {known})")
    return entries[name]


@schedule.command(cls=CeleryCommand, name="list")
@click.option("--json", "as_json", is_flag=True, help="one JSON document instead of the table")
@click.pass_context
def schedule_list(ctx: click.Context, as_json: bool) -> None:
    """Each entry: its task and schedule, paused or not, its last send and when it is next due; the leader."""
    from celery_durable.planning.beat_ticks import next_occurrence
    from celery_durable.store import beat as beat_store
    from celery_durable.store.engine import autocommit, ensure_schema, unavailable_as_error
    from celery_durable.store.runs import now

    _, url, beat, entries = _beat_of(ctx)
    try:
        with unavailable_as_error(url), autocommit(ensure_schema(url)).connect() as conn:
            states = beat_store.entry_states(conn, beat)
            lead = beat_store.leadership(conn, beat)
    except Exception as err:  # noqa: BLE001 - one line naming the store, no traceback
        raise click.ClickException(str(err).splitlines()[0]) from None
    at = now()
    report = []
    for name, entry in entries.items():
        state = states.get(name)
        report.append({
            "entry": name, "task": entry.task, "schedule": str(entry.schedule), "catch_up": entry.catch_up,
            "paused": bool(state and state.paused),
            "last_tick": state.last_tick.isoformat() if state and state.last_tick else None,
            "last_sent_at": state.last_fire_at.isoformat() if state and state.last_fire_at else None,
            "next_due": (None if state and state.paused else
                         next_occurrence(entry.schedule, state.watermark if state else at).isoformat()),
        })
    leader = None if lead is None or lead.expires_at < at else {"holder": lead.holder, "term": lead.term,
                                                                 "expires_at": lead.expires_at.isoformat()}
    if as_json:
        click.echo(json.dumps({"beat": beat, "leader": leader, "entries": report}, indent=2))
        return
    click.echo(f"beat {beat!r}: " + (f"led by {leader['holder']} (term {leader['term']})" if leader
                                     else "no replica leads now"))
    for row in report:
        status = "paused" if row["paused"] else f"next {row['next_due']}"
        click.echo(f"  {row['entry']:<24} {row['task']:<32} {row['schedule']:<28} catch-up {row['catch_up']:<8} "
                   f"{status}; last sent {row['last_tick'] or 'never'}")


@schedule.command(cls=CeleryCommand, name="pause")
@click.argument("name")
@click.pass_context
def schedule_pause(ctx: click.Context, name: str) -> None:
    """Stop sending NAME until it is resumed (every replica: the leader reads it each round)."""
    _set_paused(ctx, name, True)


@schedule.command(cls=CeleryCommand, name="resume")
@click.argument("name")
@click.pass_context
def schedule_resume(ctx: click.Context, name: str) -> None:
    """Send NAME again from now on (ticks that fell due while it was paused are not sent)."""
    _set_paused(ctx, name, False)


def _set_paused(ctx: click.Context, name: str, paused: bool) -> None:
    from celery_durable.store import beat as beat_store
    from celery_durable.store.engine import ensure_schema, unavailable_as_error
    from celery_durable.store.runs import now

    _, url, beat, entries = _beat_of(ctx)
    _entry_named(entries, name)
    try:
        with unavailable_as_error(url), ensure_schema(url).begin() as conn:
            beat_store.set_paused(conn, beat, name, paused, now())
    except Exception as err:  # noqa: BLE001 - one line naming the store, no traceback
        raise click.ClickException(str(err).splitlines()[0]) from None
    click.echo(f"{name}: {'paused' if paused else 'resumed'}")


@schedule.command(cls=CeleryCommand, name="trigger")
@click.argument("name")
@click.pass_context
def schedule_trigger(ctx: click.Context, name: str) -> None:
    """Send NAME's task once now, outside its schedule (its ticks are not moved); prints the task id."""
    import uuid

    from celery_durable import outbox
    from celery_durable.outbox.relay import Relay
    from celery_durable.store.engine import ensure_schema, unavailable_as_error

    app, url, _, entries = _beat_of(ctx)
    entry = _entry_named(entries, name)
    task_id = str(uuid.uuid4())
    headers = dict(entry.options.get("headers") or {})
    headers.update(celery_beat_task=True, durable_beat_entry=name, durable_beat_trigger="manual")
    try:
        with unavailable_as_error(url), ensure_schema(url).begin() as conn:
            outbox.enqueue(conn, app.signature(entry.task, entry.args, entry.kwargs), task_id=task_id,
                           **{**entry.options, "headers": headers})
    except Exception as err:  # noqa: BLE001 - one line naming the store, no traceback
        raise click.ClickException(str(err).splitlines()[0]) from None
    try:
        published = Relay(app, url=url, listen=False).run_pass()  # out now, not at a relay's next poll
        late = published.error
    except Exception as err:  # noqa: BLE001 - the row is committed: a relay publishes it
        late = str(err).splitlines()[0]
    if late:
        click.echo(f"{name}: in the outbox, not published yet ({late}); a relay publishes it", err=True)
    click.echo(task_id)
