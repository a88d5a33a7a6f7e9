"""``celery durable schedule``: the durable beat's entries — list them, pause or resume one, send one now.

Adding, editing and removing entries at run time: ``cli/schedule_edit.py``.
"""

from __future__ import annotations

import json
from typing import Any

import click
from celery.bin.base import CeleryCommand

from celery_durable.cli.group import durable, store_url_of
from celery_durable.config import from_celery_conf


@durable.group(name="schedule")
def schedule() -> None:
    """The durable beat's schedule: list the entries, pause or resume one, send one now; add, edit or
    remove entries stored at run time (the app's beat_schedule stays read-only)."""


def _beat_of(ctx: click.Context) -> tuple[Any, str, str, dict[str, Any], frozenset[str]]:
    """(app, store url, beat name, entries, the names of the stored ones): the app's beat_schedule,
    checked, and the entries stored at run time (a name of both: the code's); one line when not."""
    from celery_durable.beat.entries import read_entries
    from celery_durable.errors import DurableError

    app = ctx.find_root().obj.app
    app.loader.import_default_modules()
    try:
        config = from_celery_conf(app.conf)
        entries = read_entries(app, app.conf.beat_schedule or {})
    except DurableError as err:
        raise click.ClickException(str(err)) from None
    url, beat = store_url_of(app), config.beat_name or app.main or "celery"
    stored = _stored(app, url, beat, set(entries))
    return app, url, beat, {**entries, **stored}, frozenset(stored)


def _stored(app: Any, url: str, beat: str, code: set[str]) -> dict[str, Any]:
    """The stored entries as the beat runs them; one that does not read is named on stderr, not shown."""
    from celery_durable.beat.stored import readable
    from celery_durable.store.beat_schedule import stored_entries
    from celery_durable.store.engine import autocommit, ensure_schema, unavailable_as_error

    try:
        with unavailable_as_error(url), autocommit(ensure_schema(url)).connect() as conn:
            rows = stored_entries(conn, beat)
    except Exception as err:  # noqa: BLE001 - one line naming the store, no traceback
        raise click.ClickException(str(err).splitlines()[0]) from None
    # A name of both is the code's: the beat runs that one, and so do these commands.
    entries, unreadable = readable(app, rows, code)
    for refusal in unreadable.values():
        click.echo(f"warning: {refusal} (stored; the beat does not run it)", err=True)
    return entries


def _entry_named(entries: dict[str, Any], name: str) -> Any:
    if name not in entries:
        known = ", ".join(sorted(entries)) or "none"
        raise click.ClickException(f"no schedule entry named {name!r} (entries: {known})")
    return entries[name]


@schedule.command(cls=CeleryCommand, name="list")
@click.option("--json", "as_json", is_flag=True, help="one JSON document instead of the table")
@click.pass_context
def schedule_list(ctx: click.Context, as_json: bool) -> None:
    """Each entry: its task and schedule, paused or not, its last send and when it is next due; the leader."""
    from celery_durable.clock import SYSTEM_CLOCK
    from celery_durable.planning.beat_ticks import next_occurrence
    from celery_durable.store import beat as beat_store
    from celery_durable.store.engine import autocommit, ensure_schema, unavailable_as_error

    _, url, beat, entries, stored = _beat_of(ctx)
    try:
        with unavailable_as_error(url), autocommit(ensure_schema(url)).connect() as conn:
            states = beat_store.entry_states(conn, beat)
            lead = beat_store.leadership(conn, beat)
    except Exception as err:  # noqa: BLE001 - one line naming the store, no traceback
        raise click.ClickException(str(err).splitlines()[0]) from None
    at = SYSTEM_CLOCK.now()
    report = []
    for name, entry in entries.items():
        state = states.get(name)
        report.append({
            "entry": name, "source": "stored" if name in stored else "code", "task": entry.task,
            "schedule": str(entry.schedule), "catch_up": entry.catch_up,
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
        click.echo(f"  {row['entry']:<24} {row['source']:<6} {row['task']:<32} {row['schedule']:<28} "
                   f"catch-up {row['catch_up']:<8} {status}; last sent {row['last_tick'] or 'never'}")


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
    from celery_durable.clock import SYSTEM_CLOCK
    from celery_durable.store import beat as beat_store
    from celery_durable.store.engine import ensure_schema, unavailable_as_error

    _, url, beat, entries, _ = _beat_of(ctx)
    _entry_named(entries, name)
    try:
        with unavailable_as_error(url), ensure_schema(url).begin() as conn:
            beat_store.set_paused(conn, beat, name, paused, SYSTEM_CLOCK.now())
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

    app, url, _, entries, _ = _beat_of(ctx)
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
