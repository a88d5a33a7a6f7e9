"""The leader's entries each round: the app's ``beat_schedule`` with the entries stored at run time merged in.

The leader reads ``durable_beat_schedule`` once a round, inside the round's first transaction (the
one that reads the watermarks), so an add, an edit or a remove is running, changed or stopped by the
leader's next round: rounds are at most ``durable_beat_lease_ttl / 3`` apart (the lease is renewed
that often), which bounds how long a change waits without a setting of its own or an extra
connection. A row is turned into a :class:`BeatEntry` only when it changed since the last round.

Entries from code win: a stored entry of the same name (stored before the code grew one) is not
run, and said once. A stored row that no longer reads (a crontab this Celery parses differently)
is skipped with a warning instead of stopping the beat.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from sqlalchemy.engine import Connection

from celery_durable.beat.entries import BeatEntry, read_entry
from celery_durable.errors import BeatEntryInvalid
from celery_durable.store import beat_schedule as store
from celery_durable.store.beat_schedule import StoredEntry

logger = logging.getLogger("celery_durable.beat")


def as_beat_entry(app: Any, entry: StoredEntry) -> BeatEntry:
    """``entry`` as the beat runs it, its schedule checked to say when it is next due (the checks of
    ``beat_schedule``, but for the task's registration: it may be a task only the workers know)."""
    try:
        return read_entry(app, entry.name, entry.as_config(), stored=True)
    except BeatEntryInvalid as err:
        raise BeatEntryInvalid(str(err).replace("beat_schedule entry", "schedule entry", 1)) from None


def readable(app: Any, rows: Mapping[str, StoredEntry],
             code: Collection[str]) -> tuple[dict[str, BeatEntry], dict[str, BeatEntryInvalid]]:
    """The stored ``rows`` the beat would run beside the entries named ``code``, and apart, with why, those that
    do not read. A name of both is the code's: left out, as the leader leaves it out."""
    entries: dict[str, BeatEntry] = {}
    unreadable: dict[str, BeatEntryInvalid] = {}
    for name, row in rows.items():
        if name in code:
            continue
        try:
            entries[name] = as_beat_entry(app, row)
        except BeatEntryInvalid as err:
            unreadable[name] = err
    return entries, unreadable


class MergedSchedule:
    """The entries a leader runs: ``code`` (read once at start) and the stored ones, read each round."""

    def __init__(self, app: Any, beat: str, code: Mapping[str, BeatEntry]) -> None:
        self.app = app
        self.beat = beat
        self.code = dict(code)
        #: Each stored row as last read, and what it became (None: it did not read).
        self._seen: dict[str, tuple[StoredEntry, BeatEntry | None]] = {}
        self._shadowed: set[str] = set()
        #: Whether a round has read the rows yet: what the first round finds was there before this leader
        #: (``stored_entry_loaded``), not added (a new leader would otherwise say every entry was just added).
        self._loaded = False

    def entries(self, conn: Connection) -> dict[str, BeatEntry]:
        """The entries to run this round, in the caller's transaction."""
        return self.merge(store.stored_entries(conn, self.beat))

    def merge(self, rows: Mapping[str, StoredEntry]) -> dict[str, BeatEntry]:
        merged = dict(self.code)
        for name, row in rows.items():
            if name in self.code:
                self._shadow(name)
                continue
            seen = self._seen.get(name)
            if seen is None or seen[0] != row:
                change = "edited" if seen is not None else "added" if self._loaded else "loaded"
                self._seen[name] = (row, self._read(row, change))
            entry = self._seen[name][1]
            if entry is not None:
                merged[name] = entry
        for name in [name for name in self._seen if name not in rows]:
            del self._seen[name]
            logger.info("durable.beat.stored_entry_removed beat=%s entry=%s", self.beat, name,
                        extra={"event": "durable.beat.stored_entry_removed", "beat": self.beat, "entry": name})
        self._loaded = True
        return merged

    def _read(self, row: StoredEntry, change: str) -> BeatEntry | None:
        try:
            entry = as_beat_entry(self.app, row)
        except BeatEntryInvalid as err:
            logger.warning("durable.beat.stored_entry_unreadable beat=%s entry=%s error=%s: not run",
                           self.beat, row.name, err, extra={"event": "durable.beat.stored_entry_unreadable",
                                                            "beat": self.beat, "entry": row.name,
                                                            "error": str(err)})
            return None
        schedule = str(entry.schedule)
        logger.info("durable.beat.stored_entry_%s beat=%s entry=%s task=%s schedule=%s", change, self.beat,
                    row.name, row.task, schedule,
                    extra={"event": f"durable.beat.stored_entry_{change}", "beat": self.beat, "entry": row.name,
                           "task": row.task, "schedule": schedule})
        return entry

    def _shadow(self, name: str) -> None:
        if name in self._shadowed:
            return
        self._shadowed.add(name)
        logger.warning("durable.beat.stored_entry_shadowed beat=%s entry=%s: beat_schedule has an entry of "
                       "this name; the stored one is not run", self.beat, name,
                       extra={"event": "durable.beat.stored_entry_shadowed", "beat": self.beat, "entry": name})
