"""Checks a beat entry added or edited at run time, field by field, naming the field that is wrong (no I/O).

Fields come from the command line (``--args '[1]'``: JSON text) or from Python (``args=[1]``); both
are accepted and both are stored as JSON, so a value that JSON cannot carry is refused here rather
than at the first send. The task name is not looked up in the app: an entry added at run time may
name a task only the workers import (beat sends by name, as stock beat does); the command line
warns when the app it loaded does not know it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from celery.schedules import crontab as celery_crontab

from celery_durable.beat.entries import CATCH_UP_OPTION
from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.errors import BeatEntryInvalid
from celery_durable.planning.beat_ticks import CATCH_UP_CHOICES, next_occurrence
from celery_durable.store.beat_schedule import StoredEntry

#: The fields an add or an edit may give (the command line's options, without the dashes).
FIELDS = ("task", "every", "crontab", "args", "kwargs", "queue", "options")

#: The column widths of ``durable_beat_schedule``.
NAME_MAX, TASK_MAX, CRONTAB_MAX = 200, 255, 200


def checked_new(name: Any, *, task: Any, every: Any = None, crontab: Any = None, args: Any = None,
                kwargs: Any = None, queue: Any = None, options: Any = None) -> StoredEntry:
    """A new entry from its fields, each checked: exactly one of ``every`` (seconds) or ``crontab``."""
    name = checked_name(name)
    if (every is None) == (crontab is None):
        raise _bad(name, "give exactly one schedule: every (seconds) or crontab (a crontab line), "
                         f"got every={every!r}, crontab={crontab!r}")
    entry = StoredEntry(name, _task(name, task))
    return _changed(entry, every=every, crontab=crontab, args=args, kwargs=kwargs, queue=queue, options=options)


def checked_edit(current: StoredEntry, *, task: Any = None, every: Any = None, crontab: Any = None,
                 args: Any = None, kwargs: Any = None, queue: Any = None, options: Any = None) -> StoredEntry:
    """``current`` with the fields given replaced (None: kept); a new ``every`` replaces a crontab and
    the other way round. ``options`` replaces the options whole; ``queue`` then sets their queue."""
    given = {"task": task, "every": every, "crontab": crontab, "args": args, "kwargs": kwargs, "queue": queue,
             "options": options}
    if all(value is None for value in given.values()):
        raise _bad(current.name, f"nothing to change: give at least one of {', '.join(FIELDS)}")
    if every is not None and crontab is not None:
        raise _bad(current.name, f"give one schedule, every or crontab, not both (got every={every!r}, "
                                 f"crontab={crontab!r})")
    entry = current if task is None else replace(current, task=_task(current.name, task))
    return _changed(entry, every=every, crontab=crontab, args=args, kwargs=kwargs, queue=queue, options=options)


def checked_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip() or len(name) > NAME_MAX:
        raise BeatEntryInvalid(f"schedule entry {name!r}: name must be a string of 1 to {NAME_MAX} characters")
    return name


def _changed(entry: StoredEntry, *, every: Any, crontab: Any, args: Any, kwargs: Any, queue: Any,
             options: Any) -> StoredEntry:
    name = entry.name
    if every is not None:
        entry = replace(entry, every=_every(name, every), crontab=None)
    if crontab is not None:
        entry = replace(entry, every=None, crontab=_crontab(name, crontab))
    if args is not None:
        value = _json(name, "args", args)
        if not isinstance(value, (list, tuple)):
            raise _bad(name, f"args must be a JSON list, got {value!r}")
        entry = replace(entry, args=tuple(value))
    if kwargs is not None:
        entry = replace(entry, kwargs=_object(name, "kwargs", kwargs))
    if options is not None:
        entry = replace(entry, options=_options(name, _object(name, "options", options)))
    if queue is not None:
        if not isinstance(queue, str) or not queue.strip() or any(c.isspace() for c in queue):
            raise _bad(name, f"queue must be a queue name (no spaces), got {queue!r}")
        entry = replace(entry, options={**entry.options, "queue": queue})
    return entry


def _task(name: str, task: Any) -> str:
    if not isinstance(task, str) or not task or len(task) > TASK_MAX or any(c.isspace() for c in task):
        raise _bad(name, f"task must be a task name (1 to {TASK_MAX} characters, no spaces), got {task!r}")
    return task


def _every(name: str, every: Any) -> float:
    if isinstance(every, str):
        try:
            every = float(every)
        except ValueError:
            raise _bad(name, f"every must be a number of seconds, got {every!r}") from None
    if isinstance(every, bool) or not isinstance(every, (int, float)):
        raise _bad(name, f"every must be a number of seconds, got {every!r}")
    if not math.isfinite(every) or every <= 0:
        raise _bad(name, f"every must be more than 0 seconds, got {every!r}")
    return float(every)


def _crontab(name: str, given: Any) -> str:
    if not isinstance(given, str) or len(given) > CRONTAB_MAX:
        raise _bad(name, f"crontab must be a crontab line of at most {CRONTAB_MAX} characters, got {given!r}")
    line = " ".join(given.split())
    try:
        # Asked when it is next due: Celery < 5.7 builds a crontab no date matches and fails only then.
        next_occurrence(celery_crontab.from_string(line), SYSTEM_CLOCK.now())
    except Exception as err:  # noqa: BLE001 - whatever the parser says is wrong, named
        raise _bad(name, f"crontab {line!r} is not a crontab line (minute hour day-of-month month "
                         f"day-of-week): {err}") from None
    return line


def _options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    catch_up = options.get(CATCH_UP_OPTION)
    if catch_up is not None and catch_up not in CATCH_UP_CHOICES:
        raise _bad(name, f"options {CATCH_UP_OPTION} must be one of {CATCH_UP_CHOICES}, got {catch_up!r}")
    return options


def _object(name: str, field: str, given: Any) -> dict[str, Any]:
    value = _json(name, field, given)
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise _bad(name, f"{field} must be a JSON object (string keys), got {value!r}")
    return dict(value)


def _json(name: str, field: str, given: Any) -> Any:
    """JSON text decoded, or a Python value checked to survive JSON (it is stored as JSON)."""
    if isinstance(given, str):
        try:
            return json.loads(given)
        except ValueError as err:
            raise _bad(name, f"{field} is not JSON ({err}): {given!r}") from None
    try:
        json.dumps(given, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise _bad(name, f"{field} must be JSON values (it is stored as JSON): {err}") from None
    return given


def _bad(name: str, problem: str) -> BeatEntryInvalid:
    return BeatEntryInvalid(f"schedule entry {name!r}: {problem}")
