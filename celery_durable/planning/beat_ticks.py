"""Pure: which occurrences of a beat entry a leader sends now, from the stored watermark.

An entry's *watermark* is the latest occurrence already decided (sent, or
passed over by its catch-up policy); it is stored with the fire that moves
it, so a new leader continues exactly where the last one stopped. Nothing is
read from a local schedule file: a replica on a fresh disk plans the same.

Occurrences are computed from the schedule alone (``next_occurrence``), never
from the clock, so two replicas name the same tick with the same instant —
the tick is the fire's identity (its task id derives from it).

A tick up to ``grace`` seconds late is *on time* and always sent: a leader
handover (a standby takes over within the lease TTL) is not an outage. Older
ticks were *missed* and follow the entry's catch-up policy:

- ``"none"``: none is sent;
- ``"skip"`` (the default): only the latest missed occurrence is sent, as itself;
- ``"run_once"``: one send stands for them all, as the first missed occurrence,
  naming the span it covers;
- ``"all"``: every one, oldest first, at most ``max_catch_up`` (the plan says
  how many it cut).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

NONE = "none"
SKIP = "skip"
RUN_ONCE = "run_once"
ALL = "all"
CATCH_UP_CHOICES = (NONE, SKIP, RUN_ONCE, ALL)
DEFAULT_CATCH_UP = SKIP

#: Occurrences walked one by one before a plan gives up walking and jumps (a schedule of one
#: second down for a year has 31 million; a plan never needs more than ``max_catch_up`` of them).
WALK_LIMIT = 10_000


class ScheduleUnusable(ValueError):
    """An entry's schedule gave no occurrence after a time (a schedule object that misbehaves)."""


class Schedule(Protocol):
    """A Celery schedule as the planner asks it: time to the next occurrence, its clock pinned by ``nowfun``."""

    nowfun: Any

    def remaining_estimate(self, last_run_at: datetime) -> timedelta: ...


@dataclass(frozen=True)
class Fire:
    """One send: the occurrence it stands for, the entry's watermark once it is made (written in
    the same transaction), and (``run_once``) the missed span it covers."""

    tick: datetime
    watermark: datetime
    covers_from: datetime | None = None
    covers_to: datetime | None = None


@dataclass(frozen=True)
class TickPlan:
    """The sends due now, in order, and the watermark once they are all made."""

    fires: tuple[Fire, ...]
    watermark: datetime
    #: ``"all"``: missed occurrences past ``max_catch_up`` that are not sent (a lower bound when
    #: they were too many to count: see ``cut_exact``).
    cut: int = 0
    cut_exact: bool = True
    #: The first and latest missed occurrences (None: nothing was missed).
    missed_from: datetime | None = None
    missed_to: datetime | None = None
    #: The first occurrence after ``watermark``: when to look again.
    next_due: datetime = field(default_factory=lambda: datetime.max.replace(tzinfo=timezone.utc))


def next_occurrence(schedule: Schedule, after: datetime) -> datetime:
    """The first occurrence of ``schedule`` strictly after ``after`` (UTC), from the schedule alone.

    Celery's schedules answer "how long from now until due, given the last
    run"; asked with *now* pinned to ``after`` (a copy's ``nowfun``), that is
    the distance from ``after`` to the next occurrence, whatever the clock says.
    """
    pinned = copy.copy(schedule)
    pinned.nowfun = lambda: after
    try:
        remaining = pinned.remaining_estimate(after)
    except RuntimeError as err:
        # Celery < 5.7 accepts a crontab no date matches (day 31 of February) and fails here ("unable to
        # rollover"); 5.7 refuses it when it is built.
        raise ScheduleUnusable(f"schedule {schedule!r} has no occurrence: {err}") from None
    occurrence: datetime = (after + remaining).astimezone(timezone.utc)
    if occurrence <= after:
        raise ScheduleUnusable(f"schedule {schedule!r} gave no occurrence after {after.isoformat()}")
    return occurrence


def occurrences(schedule: Schedule, after: datetime, until: datetime) -> Iterator[datetime]:
    """Occurrences in (``after``, ``until``], oldest first."""
    current = next_occurrence(schedule, after)
    while current <= until:
        yield current
        current = next_occurrence(schedule, current)


def latest_occurrence(schedule: Schedule, after: datetime, until: datetime, *,
                      every: timedelta | None) -> datetime | None:
    """The latest occurrence in (``after``, ``until``], or None, in O(log) schedule calls.

    ``every``: the schedule's fixed interval when its occurrences are counted
    from the last one (``beat.entries.fixed_interval``), None for a calendar
    schedule. An interval counts its occurrences from ``after``. A calendar schedule
    (crontab, solar) has the same occurrences from any start: gallop back from
    ``until`` (1 s, 2 s, 4 s, ...) to a start with an occurrence before
    ``until``, then walk forward from there.
    """
    first = next_occurrence(schedule, after)
    if first > until:
        return None
    if every is not None:
        # An interval's occurrences are counted from ``after`` (the last one), not set by the
        # calendar: galloping from another start would leave the entry's own grid.
        return after + every * ((until - after) // every)
    back = timedelta(seconds=1)
    while True:
        start = max(until - back, after)
        found = next_occurrence(schedule, start)
        if found <= until:
            break
        back *= 2
    latest = found
    for occurrence in occurrences(schedule, found, until):
        latest = occurrence
    return latest


def plan_ticks(schedule: Schedule, watermark: datetime, now: datetime, *, catch_up: str, grace: float,
               max_catch_up: int, every: timedelta | None) -> TickPlan:
    """What to send for one entry at ``now``, given its watermark and policy (``every``: see ``latest_occurrence``)."""
    if catch_up not in CATCH_UP_CHOICES:
        raise ValueError(f"catch_up must be one of {CATCH_UP_CHOICES}, got {catch_up!r}")
    if max_catch_up < 1:
        raise ValueError(f"max_catch_up must be at least 1, got {max_catch_up!r}")
    on_time_from = now - timedelta(seconds=grace)
    fires: list[Fire] = []
    cut, cut_exact = 0, True
    missed_first = None
    missed_latest = latest_occurrence(schedule, watermark, on_time_from, every=every)
    if missed_latest is not None:
        missed_first = next_occurrence(schedule, watermark)
        if catch_up == SKIP:
            fires.append(Fire(missed_latest, missed_latest))
        elif catch_up == RUN_ONCE:
            fires.append(Fire(missed_first, missed_latest, covers_from=missed_first, covers_to=missed_latest))
        elif catch_up == ALL:
            walked = _take(occurrences(schedule, watermark, on_time_from), max_catch_up + WALK_LIMIT)
            kept = walked[:max_catch_up]
            # The last one kept carries the watermark past the ones cut: a leader that takes over
            # after it does not count them missed again.
            fires.extend(Fire(tick, tick if tick is not kept[-1] else missed_latest) for tick in kept)
            cut = len(walked) - len(kept)
            cut_exact = len(walked) < max_catch_up + WALK_LIMIT
        watermark = missed_latest
    fires.extend(Fire(tick, tick) for tick in occurrences(schedule, watermark, now))
    if fires:
        watermark = max(watermark, fires[-1].watermark)
    return TickPlan(tuple(fires), watermark, cut, cut_exact, missed_first, missed_latest,
                    next_occurrence(schedule, watermark))


def _take(iterator: Iterator[datetime], count: int) -> list[datetime]:
    out: list[datetime] = []
    for item in iterator:
        out.append(item)
        if len(out) >= count:
            break
    return out
