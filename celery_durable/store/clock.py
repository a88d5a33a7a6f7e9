"""The store's clock: the one time every lease is written and compared in, whatever each host's clock says.

Leases (run leases, fleet-limit leases and rate turns, the beat's leader
lease) are expiries that one process writes and others compare. Written with
each worker's own wall clock, a worker 60 s ahead would see every other
worker's leases as expired (and take over live runs); one 60 s behind would
write leases that look expired on arrival. So they are written and compared
in the database's time: PostgreSQL's ``clock_timestamp()``, read once every
``RESAMPLE_AFTER`` seconds per store and carried forward with this process's
monotonic clock (which no wall-clock step moves). On SQLite the store lives on
this host, whose clock is the only one.

It reads this process's clocks through ``celery_durable.clock.Clock`` (a test
may give a fake one), and :class:`StoreClock` is the store's time as that same
interface: its ``now()`` is the database's, its ``monotonic()`` this process's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy.engine import Connection, Engine

from celery_durable.clock import SYSTEM_CLOCK, Clock
from celery_durable.store.urls import rendered

#: Seconds a reading of the database's clock is carried forward before it is read again.
RESAMPLE_AFTER = 10.0


@dataclass(frozen=True)
class _Reading:
    db_time: datetime
    at: float  # this process's monotonic clock when the database read db_time


#: Per store and local clock (a reading's ``at`` is in that clock's monotonic time).
_readings: dict[tuple[str, Clock], _Reading] = {}
_lock = threading.Lock()


class StoreClock:
    """The store's time as a :class:`~celery_durable.clock.Clock`: ``now()`` is the database's (read on a
    connection of its own when the reading is stale), ``monotonic()`` the local clock's."""

    def __init__(self, engine: Engine, local: Clock = SYSTEM_CLOCK) -> None:
        self.engine = engine
        self.local = local

    def monotonic(self) -> float:
        return self.local.monotonic()

    def now(self) -> datetime:
        return engine_now(self.engine, self.local)

    def now_in(self, conn: Connection) -> datetime:
        """Now, read on ``conn`` when it is due for reading (no second connection)."""
        return store_now(conn, self.local)


def store_now(conn: Connection, clock: Clock = SYSTEM_CLOCK) -> datetime:
    """Now, as the store's database reads it (an aware UTC datetime); on SQLite, this host's clock."""
    if conn.dialect.name != "postgresql":
        return clock.now()
    reading = _fresh(conn.engine, clock)
    if reading is None:
        reading = _read(conn, clock)
        with _lock:
            _readings[(_key(conn.engine), clock)] = reading
    return reading.db_time + timedelta(seconds=clock.monotonic() - reading.at)


def engine_now(engine: Engine, clock: Clock = SYSTEM_CLOCK) -> datetime:
    """:func:`store_now` outside a transaction: a connection is taken only when the reading is stale."""
    if engine.dialect.name != "postgresql":
        return clock.now()
    reading = _fresh(engine, clock)
    if reading is not None:
        return reading.db_time + timedelta(seconds=clock.monotonic() - reading.at)
    with engine.connect() as conn:
        return store_now(conn, clock)


def _key(engine: Engine) -> str:
    return rendered(engine.url, hide_password=True)


def _fresh(engine: Engine, clock: Clock) -> _Reading | None:
    with _lock:
        reading = _readings.get((_key(engine), clock))
    if reading is None or clock.monotonic() - reading.at > RESAMPLE_AFTER:
        return None
    return reading


def _read(conn: Connection, clock: Clock) -> _Reading:
    before = clock.monotonic()
    db_time = conn.exec_driver_sql("SELECT clock_timestamp()").scalar_one()
    after = clock.monotonic()
    # The database read its clock somewhere in the round trip: its middle is the best guess.
    return _Reading(db_time.astimezone(timezone.utc), (before + after) / 2)
