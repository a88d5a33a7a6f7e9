"""Add, edit and remove the durable beat's entries at run time: the Python API, and what the command line calls.

::

    from celery_durable.beat import schedule_entries
    schedule_entries.add(app, "ping-db", task="ops.ping", every=30, kwargs={"db": "main"}, queue="ops")
    schedule_entries.edit(app, "ping-db", crontab="*/5 * * * *")
    schedule_entries.remove(app, "ping-db")

The entries are rows of the durable store beside the app's ``beat_schedule`` (which stays in code and
read-only here); the beat's leader takes a change at its next round, without a restart. Each call
goes through :func:`apply`: the fields checked (``stored_spec``), the name checked against the
app's ``beat_schedule``, then the row written in one transaction that holds the row locked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_durable.beat.stored import as_beat_entry
from celery_durable.beat.stored_spec import checked_edit, checked_name, checked_new
from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.config import from_celery_conf
from celery_durable.errors import BeatEntryInvalid, ScheduleEditRefused
from celery_durable.store import beat_schedule as store
from celery_durable.store.beat_schedule import StoredEntry
from celery_durable.store.engine import ensure_schema, store_url, unavailable_as_error

ADD, EDIT, REMOVE = "add", "edit", "remove"


@dataclass(frozen=True)
class Change:
    """One change to a stored entry: ``action`` (add, edit, remove) of ``name`` with ``fields``
    (task, every, crontab, args, kwargs, queue, options; None: not given)."""

    action: str
    name: str
    fields: Mapping[str, Any] = field(default_factory=dict)


def add(app: Any, name: str, *, task: str, every: float | None = None, crontab: str | None = None,
        args: Any = None, kwargs: Any = None, queue: str | None = None, options: Any = None) -> StoredEntry:
    """Store a new entry: ``task`` every ``every`` seconds or on a ``crontab`` line (exactly one)."""
    entry = apply(app, Change(ADD, name, dict(task=task, every=every, crontab=crontab, args=args, kwargs=kwargs,
                                              queue=queue, options=options)))
    assert entry is not None  # an add returns what it stored
    return entry


def edit(app: Any, name: str, *, task: str | None = None, every: float | None = None, crontab: str | None = None,
         args: Any = None, kwargs: Any = None, queue: str | None = None, options: Any = None) -> StoredEntry:
    """Change the fields given of a stored entry (the others kept); its ticks run on from its watermark."""
    entry = apply(app, Change(EDIT, name, dict(task=task, every=every, crontab=crontab, args=args, kwargs=kwargs,
                                               queue=queue, options=options)))
    assert entry is not None  # an edit returns what it stored
    return entry


def remove(app: Any, name: str) -> None:
    """Delete a stored entry (and its watermark and pause): no send of it once the leader's round ends."""
    apply(app, Change(REMOVE, name))


def apply(app: Any, change: Change) -> StoredEntry | None:
    """Check ``change`` and write it: the one path of every add, edit and remove. Raises
    :class:`BeatEntryInvalid` naming a bad field, :class:`ScheduleEditRefused` when the name is the
    app's (``beat_schedule``), already stored (add) or not stored (edit, remove)."""
    if change.action not in (ADD, EDIT, REMOVE):
        raise ValueError(f"change action must be one of {ADD}, {EDIT}, {REMOVE}, got {change.action!r}")
    name = checked_name(change.name)
    code = app.conf.beat_schedule or {}
    if name in code:
        what = "an entry of that name is" if change.action == ADD else "it is"
        raise ScheduleEditRefused(f"schedule entry {name!r}: {what} in the app's beat_schedule, read-only here "
                                  f"(change it in code); {change.action} refused")
    new = checked_new(name, **change.fields) if change.action == ADD else None
    if new is not None:
        as_beat_entry(app, new)  # the schedule can say when it is next due (checked before any write)
    config = from_celery_conf(app.conf)
    beat = config.beat_name or app.main or "celery"
    url = store_url(app)
    now = SYSTEM_CLOCK.now()
    with unavailable_as_error(url), ensure_schema(url).begin() as conn:
        current = store.stored_entry(conn, beat, name)
        if change.action == ADD:
            assert new is not None
            if current is not None or not store.insert(conn, beat, new, now):
                raise ScheduleEditRefused(f"schedule entry {name!r} is stored already: edit it, or remove it "
                                          f"first; add refused")
            return new
        if current is None:
            known = ", ".join(sorted(store.stored_entries(conn, beat))) or "none"
            raise ScheduleEditRefused(f"no stored schedule entry named {name!r} (stored: {known}); "
                                      f"{change.action} refused")
        if change.action == REMOVE:
            store.delete(conn, beat, name)
            return None
        edited = checked_edit(current, **change.fields)
        as_beat_entry(app, edited)
        store.update(conn, beat, edited, now)
        return edited


__all__ = ["ADD", "EDIT", "REMOVE", "BeatEntryInvalid", "Change", "ScheduleEditRefused", "StoredEntry", "add",
           "apply", "edit", "remove"]
