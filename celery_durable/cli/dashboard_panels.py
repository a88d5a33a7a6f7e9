"""Pure: the dashboard's panels Flower has no data for (beat, fleet limits, sleeping runs, stuck outbox), each
problem named with its cause.

Every builder takes what the store holds and ``now`` and returns the JSON the
page draws; a row with a ``problem`` (a sentence saying what is wrong and
why) is highlighted there. The reads live in ``cli/dashboard_reads.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery_durable.beat.holder import holder_parts
from celery_durable.planning.limit_declarations import KEY_SCOPE, TASK_SCOPE
from celery_durable.store.beat import EntryState, Leadership
from celery_durable.store.runs import Run

#: Seconds a waiter with room, a message due to publish, or a late wake-up may stay so before it is
#: called a problem: a release, a sweep or a wake-up normally takes well under a second, but a busy
#: host may lag a few, and a false alarm teaches operators to ignore the colour.
STUCK_AFTER = 30.0


@dataclass(frozen=True)
class ConfiguredEntry:
    """A beat entry as the dashboard's app reads it; ``next_due`` from its stored watermark."""

    name: str
    task: str
    schedule: str
    next_due: datetime | None
    #: "code" (the app's ``beat_schedule``) or "stored" (added at run time: ``celery durable schedule add``).
    source: str = "code"


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _seconds(later: datetime | None, earlier: datetime | None) -> float | None:
    return None if later is None or earlier is None else (later - earlier).total_seconds()


def _age(seconds: float) -> str:
    """Seconds as the page's problem sentences say them."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# -- beat --------------------------------------------------------------------------------------
def leader_view(lead: Leadership | None, now: datetime) -> dict[str, Any] | None:
    """The replica holding a live lease: its host and pid when its token names them, else the bare token."""
    if lead is None or lead.expires_at < now:
        return None
    parts = holder_parts(lead.holder)
    return {"holder": lead.holder, "host": parts.host if parts else None, "pid": parts.pid if parts else None,
            "term": lead.term, "expires_in_seconds": _seconds(lead.expires_at, now)}


def beat_panel(beat: str, lead: Leadership | None, configured: Sequence[ConfiguredEntry],
               states: Mapping[str, EntryState], now: datetime, grace: float) -> dict[str, Any]:
    """The beat's leader, its entries (next and last send, the last send's lag, paused) and what is late.

    ``grace``: seconds late a tick is still on time (the scheduler's own: a lease handover is not an outage).
    """
    leader = leader_view(lead, now)
    who = (f"{leader['host']} pid {leader['pid']}" if leader and leader["host"] else
           f"holder {leader['holder']}" if leader else None)
    entries = []
    for entry in configured:
        state = states.get(entry.name)
        paused = bool(state and state.paused)
        late = _seconds(now, entry.next_due)
        problem = None
        if not paused and late is not None and late > grace:
            cause = f"the leader ({who}) has not sent it" if who else "no beat replica leads, so nothing is sent"
            problem = f"overdue by {_age(late)}: {cause}"
        entries.append({
            "name": entry.name, "source": entry.source, "task": entry.task, "schedule": entry.schedule,
            "paused": paused,
            "next_due": None if paused else _iso(entry.next_due),
            "last_tick": _iso(state.last_tick if state else None),
            "last_fire_at": _iso(state.last_fire_at if state else None),
            "lag_seconds": _seconds(state.last_fire_at, state.last_tick) if state else None,
            "problem": problem,
        })
    fired = [(state.last_fire_at, name, state) for name, state in states.items() if state.last_fire_at is not None]
    last = max(fired, key=lambda f: f[0], default=None)
    problem = None
    if leader is None and any(not e["paused"] for e in entries):
        problem = (f"no replica leads beat {beat!r}: no entry is sent (is `celery beat -S celery_durable.Scheduler` "
                   "running against this store?)")
    return {
        "beat": beat, "leader": leader, "entries": entries, "problem": problem,
        "last_fire": None if last is None else {
            "entry": last[1], "at": _iso(last[0]), "tick": _iso(last[2].last_tick),
            "lag_seconds": _seconds(last[0], last[2].last_tick), "ago_seconds": _seconds(now, last[0])},
    }


# -- fleet limits ------------------------------------------------------------------------------
def limits_panel(held: Sequence[tuple[str, str, str, int]],
                 waiting: Sequence[tuple[str, str, str, int, int, datetime, datetime | None]],
                 limits: Mapping[tuple[str, str], int], now: datetime) -> list[dict[str, Any]]:
    """Per scope (task, kind, key): leases held, messages waiting their turn and made ready, the limit live
    workers declare, and why waiters are stuck when they are.

    ``held``: ``store.limits.held``; ``waiting``: ``store.limit_waiting.waiting_by_scope``; ``limits``: the
    lowest limit live workers declare per (task, kind).
    """
    scopes: dict[tuple[str, str, str], dict[str, Any]] = {}

    def scope(task: str, kind: str, key: str) -> dict[str, Any]:
        return scopes.setdefault((task, kind, key), {
            "task": task, "kind": kind, "key": key, "held": 0, "waiting": 0, "ready": 0,
            "limit": limits.get((task, kind)), "oldest_waiting_seconds": None, "full": False, "problem": None})

    for task, kind, key, count in held:
        scope(task, kind, key)["held"] = count
    due: dict[tuple[str, str, str], datetime | None] = {}
    for task, kind, key, count, ready, oldest, first_due in waiting:
        row = scope(task, kind, key)
        row.update(waiting=count, ready=ready, oldest_waiting_seconds=_seconds(now, oldest))
        due[(task, kind, key)] = first_due
    for where, row in scopes.items():
        limit = row["limit"]
        row["full"] = limit is not None and row["held"] >= limit
        row["problem"] = _limit_problem(row, _seconds(now, due.get(where)))
    return [scopes[where] for where in sorted(scopes)]


def _limit_problem(row: dict[str, Any], ready_late: float | None) -> str | None:
    if row["ready"] and ready_late is not None and ready_late > STUCK_AFTER:
        return (f"{row['ready']} message(s) given their turn {_age(ready_late)} ago and not sent on: no -P durable "
                "worker's limit dispatcher is running against this store")
    waited = row["oldest_waiting_seconds"]
    if not row["waiting"] or waited is None or waited <= STUCK_AFTER:
        return None
    if row["limit"] is None and row["kind"] in (TASK_SCOPE, KEY_SCOPE):
        return (f"{row['waiting']} waiting for {_age(waited)}, and no live worker declares this limit: they wait "
                f"for a -P durable worker running {row['task']} to start")
    if row["limit"] is not None and row["held"] < row["limit"]:
        return (f"{row['waiting']} waiting for {_age(waited)} with {row['limit'] - row['held']} turn(s) free: no "
                "live worker has swept this scope (is a -P durable worker running against this store?)")
    return None


# -- sleeping runs -----------------------------------------------------------------------------
def sleeping_panel(runs: Sequence[Run], now: datetime, lease_ttl: float) -> list[dict[str, Any]]:
    """Durable runs waiting for a time: when each wakes, and the ones whose wake-up is long overdue.

    The fleet sends an overdue wake-up again one ``lease_ttl`` after it was due (tasks/recovery.py); one still
    asleep ``STUCK_AFTER`` past that has no worker taking it.
    """
    shown = []
    for run in runs:
        wakes_in = _seconds(run.wake_at, now)
        problem = None
        if wakes_in is not None and -wakes_in > lease_ttl + STUCK_AFTER:
            queue = f"queue {run.queue!r}" if run.queue else "its queue"
            problem = (f"its wake-up was due {_age(-wakes_in)} ago and it has not resumed: is a -P durable worker "
                       f"consuming {queue}?")
        shown.append({"id": run.id, "task": run.task_name, "queue": run.queue, "attempts": run.attempts,
                      "wake_at": _iso(run.wake_at), "wakes_in_seconds": wakes_in,
                      "asleep_since": _iso(run.updated_at), "problem": problem})
    return shown


# -- the outbox --------------------------------------------------------------------------------
def outbox_panel(backlog: int, oldest: datetime | None, failing: Sequence[Mapping[str, Any]], now: datetime,
                 flag_after: int) -> dict[str, Any]:
    """The unpublished backlog, and each row whose publish failed with the error it keeps (``store.outbox.failing``);
    ``flag_after``: the failed publishes after which the relay flags a row (logs an error)."""
    rows = []
    for row in failing:
        error = (row["last_error"] or "no error was recorded").strip()
        rows.append({
            "task_id": row["task_id"], "task": row["task_name"], "attempts": row["attempts"], "error": error,
            "flagged": row["attempts"] >= flag_after, "age_seconds": _seconds(now, row["created_at"]),
            "next_try_in_seconds": _seconds(row["available_at"], now),
            "problem": f"publish failed {row['attempts']} time(s): {error.splitlines()[0]}",
        })
    return {"backlog": backlog, "oldest_seconds": _seconds(now, oldest), "failing": rows,
            "problem": f"{len(rows)} outbox row(s) failed to publish and wait to be tried again" if rows else None}


def problems(panels: Mapping[str, Any]) -> list[str]:
    """Each panel's problems as one line each, for the page's summary of what is wrong."""
    found = []
    beat = panels.get("beat") or {}
    if beat.get("problem"):
        found.append(f"beat: {beat['problem']}")
    found += [f"beat entry {e['name']}: {e['problem']}" for e in beat.get("entries", []) if e["problem"]]
    found += [f"limit {s['task']} {s['kind']} {s['key']}: {s['problem']}" for s in panels.get("limits", [])
              if s["problem"]]
    found += [f"sleeping run {r['id']}: {r['problem']}" for r in panels.get("sleeping", []) if r["problem"]]
    found += [f"outbox {r['task_id']} ({r['task']}): {r['problem']}"
              for r in (panels.get("outbox") or {}).get("failing", [])]
    return found
