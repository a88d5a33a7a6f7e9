"""The ``beat_schedule`` entries a durable beat runs, read from the app's config and checked at start."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from celery.schedules import crontab, schedule, solar

from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.errors import BeatEntryInvalid
from celery_durable.planning.beat_ticks import CATCH_UP_CHOICES, DEFAULT_CATCH_UP, ScheduleUnusable, next_occurrence

#: The entry option naming its catch-up policy (``"options": {"durable_catch_up": "run_once"}``).
CATCH_UP_OPTION = "durable_catch_up"


def fixed_interval(value: Any) -> timedelta | None:
    """A schedule's interval when its occurrences are counted from the last one (Celery's ``schedule``), else None.

    The tick planner (``planning.beat_ticks``, which imports no Celery) takes it
    to find the latest missed tick on the entry's own grid; a calendar schedule
    (crontab, solar) or a relative interval has occurrences set by the clock.
    """
    if isinstance(value, schedule) and not value.relative:
        every: timedelta = value.run_every
        return every
    return None


@dataclass(frozen=True)
class BeatEntry:
    """One entry: what to send, on which schedule, and what to do about ticks missed while down."""

    name: str
    task: str
    schedule: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: apply_async options for each send (the catch-up option taken out).
    options: dict[str, Any] = field(default_factory=dict)
    catch_up: str = DEFAULT_CATCH_UP


def read_entries(app: Any, config: Mapping[str, Any]) -> dict[str, BeatEntry]:
    """Every entry of ``config`` (``app.conf.beat_schedule``), checked; the first bad one is refused
    with :class:`BeatEntryInvalid` naming it and what is wrong."""
    if not isinstance(config, Mapping):
        raise BeatEntryInvalid(f"beat_schedule must be a mapping of entry name to entry, got {config!r}")
    return {name: read_entry(app, name, spec) for name, spec in config.items()}


def read_entry(app: Any, name: Any, spec: Any, *, stored: bool = False) -> BeatEntry:
    """One entry, checked. ``stored``: an entry added at run time (``durable_beat_schedule``), whose task
    may be one only the workers import, so its name is not looked up in this app."""
    if not isinstance(name, str) or not name or len(name) > 200:
        raise BeatEntryInvalid(f"beat_schedule entry {name!r}: a name must be a string of 1 to 200 characters")
    if not isinstance(spec, Mapping):
        raise _bad(name, f"must be a mapping (task, schedule, args, kwargs, options), got {spec!r}")
    task = spec.get("task")
    if not isinstance(task, str) or not task:
        raise _bad(name, f"task must be a task name, got {task!r}")
    if not stored and task not in app.tasks:
        raise _bad(name, f"task {task!r} is not registered in this app (is the module defining it imported?)")
    the_schedule = _schedule(app, name, spec.get("schedule"))
    args = spec.get("args") or ()
    if not isinstance(args, (list, tuple)):
        raise _bad(name, f"args must be a list or tuple, got {args!r}")
    kwargs = spec.get("kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise _bad(name, f"kwargs must be a mapping, got {kwargs!r}")
    options = dict(spec.get("options") or {})
    catch_up = options.pop(CATCH_UP_OPTION, DEFAULT_CATCH_UP)
    if catch_up not in CATCH_UP_CHOICES:
        raise _bad(name, f"options {CATCH_UP_OPTION} must be one of {CATCH_UP_CHOICES}, got {catch_up!r}")
    return BeatEntry(name, task, the_schedule, tuple(args), dict(kwargs), options, catch_up)


def _schedule(app: Any, name: str, value: Any) -> Any:
    if isinstance(value, bool):
        raise _bad(name, f"schedule must be seconds, a timedelta, a crontab or a solar schedule, got {value!r}")
    if isinstance(value, (int, float)):
        if not value > 0:
            raise _bad(name, f"schedule of {value!r} seconds: must be more than 0")
        value = schedule(timedelta(seconds=float(value)), app=app)
    elif isinstance(value, timedelta):
        if value <= timedelta(0):
            raise _bad(name, f"schedule of {value!r}: must be more than 0")
        value = schedule(value, app=app)
    elif isinstance(value, str):
        # A crontab line ("*/5 * * * *"): minute, hour, day of month, month, day of week.
        try:
            value = crontab.from_string(value)
        except Exception as err:  # noqa: BLE001 - whatever the parser says is wrong, named
            raise _bad(name, f"schedule {value!r} is not a crontab line (minute hour day-of-month month "
                             f"day-of-week): {err}") from None
        value.app = app
    elif not isinstance(value, (schedule, crontab, solar)):
        raise _bad(name, f"schedule must be seconds, a timedelta, a crontab (or a crontab line) or a solar "
                         f"schedule, got {value!r}")
    try:
        next_occurrence(value, SYSTEM_CLOCK.now())
    except (ScheduleUnusable, ValueError, TypeError, AttributeError) as err:
        raise _bad(name, f"schedule {value!r} cannot say when it is next due: {err}") from err
    return value


def _bad(name: str, problem: str) -> BeatEntryInvalid:
    return BeatEntryInvalid(f"beat_schedule entry {name!r}: {problem}")
