"""The dashboard's store reads: one connection per sample, handed to the pure panel builders
(``cli/dashboard_panels.py``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Connection

from celery_durable.cli import dashboard_panels as panels
from celery_durable.config import DurableConfig

#: Rows each list shows: the page is a view, not an export (``celery durable runs`` lists them all).
DEAD_RUNS_SHOWN = 50
SLEEPING_RUNS_SHOWN = 50
FAILING_OUTBOX_SHOWN = 50


def beat_name(app: Any, config: DurableConfig) -> str:
    """The beat's name as its replicas read it (``beat/scheduler.py``)."""
    return config.beat_name or app.main or "celery"


def configured_entries(app: Any) -> dict[str, Any]:
    """The app's ``beat_schedule``, checked as beat checks it (raises DurableError naming a bad entry)."""
    from celery_durable.beat.entries import read_entries

    return read_entries(app, app.conf.beat_schedule or {})


def read_panels(conn: Connection, app: Any, config: DurableConfig) -> dict[str, Any]:
    """Every panel of the page, read in ``conn``; a part that cannot be read is a problem of its own."""
    from celery_durable.clock import SYSTEM_CLOCK
    from celery_durable.planning.outbox import FLAG_AFTER
    from celery_durable.store import outbox as store_outbox
    from celery_durable.store import run_reads
    from celery_durable.store import runs as store_runs
    from celery_durable.store.clock import store_now
    from celery_durable.store.schema import DEAD

    # Leases, wake-ups and backoffs are written in the store's clock: read them against it.
    now = store_now(conn, SYSTEM_CLOCK)
    found: dict[str, Any] = {"read_problems": []}
    try:
        found["beat"] = _beat(conn, app, config, now)
    except Exception as err:  # noqa: BLE001 - shown on the page; the other panels still are
        found["beat"] = None
        found["read_problems"].append(f"the beat could not be read: {str(err).splitlines()[0]}")
    found["limits"] = _limits(conn, now)
    found["sleeping"] = panels.sleeping_panel(store_runs.sleeping(conn, SLEEPING_RUNS_SHOWN), now, config.lease_ttl)
    backlog, oldest = store_outbox.backlog(conn)
    found["outbox"] = panels.outbox_panel(backlog, oldest, store_outbox.failing(conn, FAILING_OUTBOX_SHOWN), now,
                                          FLAG_AFTER)
    found["dead_runs"] = [{"id": run.id, "task": run.task_name, "queue": run.queue, "attempts": run.attempts,
                           "updated_at": run.updated_at.isoformat(), "last_error": run.last_error}
                          for run in run_reads.listed(conn, states=[DEAD], limit=DEAD_RUNS_SHOWN)]
    found["problems"] = found["read_problems"] + panels.problems(found)
    return found


def _beat(conn: Connection, app: Any, config: DurableConfig, now: Any) -> dict[str, Any]:
    from celery_durable.beat.scheduler import STANDBY_POLL
    from celery_durable.beat.stored import readable
    from celery_durable.planning.beat_ticks import next_occurrence
    from celery_durable.store import beat as store_beat
    from celery_durable.store.beat_schedule import stored_entries

    beat = beat_name(app, config)
    states = store_beat.entry_states(conn, beat)
    code = configured_entries(app)
    configured = []
    # Stored entries as the leader merges them; one that does not read is left out (``schedule list`` names it).
    stored, _ = readable(app, stored_entries(conn, beat), code)
    sourced = [(name, entry, "code") for name, entry in code.items()]
    sourced += [(name, entry, "stored") for name, entry in stored.items()]
    for name, entry, source in sourced:
        state = states.get(name)
        # A replica starts tracking an entry from when it first sees it: until then, from now.
        next_due = next_occurrence(entry.schedule, state.watermark if state else now)
        configured.append(panels.ConfiguredEntry(name, entry.task, str(entry.schedule), next_due, source))
    # The scheduler's own grace (beat/scheduler.py): a tick later than this is not a handover.
    grace = config.beat_lease_ttl + 2 * STANDBY_POLL
    return panels.beat_panel(beat, store_beat.leadership(conn, beat), configured, states, now, grace)


def _limits(conn: Connection, now: Any) -> list[dict[str, Any]]:
    from celery_durable.store import limit_declarations, limit_waiting
    from celery_durable.store import limits as store_limits

    held = store_limits.held(conn, now)
    waiting = limit_waiting.waiting_by_scope(conn)
    pairs = sorted({(row[0], row[1]) for row in held} | {(row[0], row[1]) for row in waiting})
    lowest = {pair: low for pair, (low, _) in limit_declarations.declared_range(conn, pairs, now).items()}
    return panels.limits_panel(held, waiting, lowest, now)
