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
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from time import monotonic

from sqlalchemy.engine import Connection, Engine

#: Seconds a reading of the database's clock is carried forward before it is read again.
RESAMPLE_AFTER = 10.0


@dataclass(frozen=True)
class _Reading:
    db_time: datetime
    at: float  # this process's monotonic clock when the database read db_time


_readings: dict[str, _Reading] = {}
_lock = threading.Lock()


def store_now(conn: Connection) -> datetime:
    """Now, as the store's database reads it (an aware UTC datetime); on SQLite, this host's clock."""
    if conn.dialect.name != "postgresql":
        return datetime.now(timezone.utc)
    reading = _fresh(conn.engine)
    if reading is None:
        reading = _read(conn)
        with _lock:
            _readings[_key(conn.engine)] = reading
    return reading.db_time + timedelta(seconds=monotonic() - reading.at)


def engine_now(engine: Engine) -> datetime:
    """:func:`store_now` outside a transaction: a connection is taken only when the reading is stale."""
    if engine.dialect.name != "postgresql":
        return datetime.now(timezone.utc)
    reading = _fresh(engine)
    if reading is not None:
        return reading.db_time + timedelta(seconds=monotonic() - reading.at)
    with engine.connect() as conn:
        return store_now(conn)


def _key(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=True)


def _fresh(engine: Engine) -> _Reading | None:
    with _lock:
        reading = _readings.get(_key(engine))
    if reading is None or monotonic() - reading.at > RESAMPLE_AFTER:
        return None
    return reading


def _read(conn: Connection) -> _Reading:
    before = monotonic()
    db_time = conn.exec_driver_sql("SELECT clock_timestamp()").scalar_one()
    after = monotonic()
    # The database read its clock somewhere in the round trip: its middle is the best guess.
    return _Reading(db_time.astimezone(timezone.utc), (before + after) / 2)
