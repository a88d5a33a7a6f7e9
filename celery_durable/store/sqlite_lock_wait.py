"""SQLite connections that wait for another process's write lock in short steps, instead of SQLite's busy handler.

Two pool children writing one SQLite file take turns at its write lock: a run's
start, checkpoints and settle are each one autocommit statement, holding the lock
for tens of microseconds. When the other child has it, SQLite's own busy handler
(``sqlite3_busy_timeout``) sleeps 1, 2, 5, 10 ms...: a millisecond at least
for a lock free again a few microseconds later, ~0.2 times a run in a
``-P durable -c 2`` worker (measured with ``perf stat`` on the children).

Here the connection has no busy handler, and a statement refused with
SQLITE_BUSY outside a transaction (the statement was its own transaction, or it
was the ``BEGIN IMMEDIATE`` that starts one: nothing of it happened) is tried
again after a pause that starts at a few microseconds and grows. The total wait
is still bounded by the busy timeout; past it the error names the setting.
Inside a transaction a refusal is raised at once, as SQLite's handler does there
(a read transaction cannot be upgraded by waiting).
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

#: SQLite's primary result code for a lock held by another connection (extended codes share the low byte).
SQLITE_BUSY = 5

#: Seconds slept before each further try: a writer holds the lock for one statement, so the
#: first tries come soon; past them the holder is a long transaction, and the pauses grow.
PAUSES = (0.0, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005)
#: The longest pause, once ``PAUSES`` is spent.
LONGEST_PAUSE = 0.01


class LockWaitExceeded(sqlite3.OperationalError):
    """Another connection held the write lock for longer than the busy timeout.

    An ``OperationalError`` like SQLite's own "database is locked", so the store reads it
    as an outage the same way.
    """


def is_busy(err: BaseException) -> bool:
    """True when SQLite refused the statement because another connection holds a lock."""
    code = getattr(err, "sqlite_errorcode", None)
    return isinstance(err, sqlite3.OperationalError) and code is not None and code & 0xFF == SQLITE_BUSY


class LockWaitingConnection(sqlite3.Connection):
    """A ``sqlite3`` connection whose cursors wait for the write lock (open it with ``timeout=0``).

    ``busy_timeout`` (seconds) bounds the wait of one statement; the store sets it from
    ``SQLITE_BUSY_TIMEOUT_MS`` when the connection is made.
    """

    busy_timeout: float = 10.0
    #: Where ``busy_timeout`` comes from, named in the error when the wait runs out.
    busy_timeout_setting: str = "celery_durable.store.engine.SQLITE_BUSY_TIMEOUT_MS"

    def cursor(self, factory: Any = None) -> Any:  # sqlite3's signature: a Cursor class
        return super().cursor(factory or LockWaitingCursor)


class LockWaitingCursor(sqlite3.Cursor):
    """Tries a statement refused for a lock again, outside a transaction, within the busy timeout."""

    connection: LockWaitingConnection

    def execute(self, sql: str, parameters: Any = (), /) -> LockWaitingCursor:
        return self._waiting(sqlite3.Cursor.execute, sql, parameters)

    def executemany(self, sql: str, seq_of_parameters: Any, /) -> LockWaitingCursor:
        # A sequence: an iterator consumed by a refused try would be empty on the next.
        rows = seq_of_parameters if isinstance(seq_of_parameters, (list, tuple)) else list(seq_of_parameters)
        return self._waiting(sqlite3.Cursor.executemany, sql, rows)

    def _waiting(self, run: Any, sql: str, parameters: Any) -> LockWaitingCursor:
        tries = 0
        deadline = 0.0
        while True:
            try:
                run(self, sql, parameters)
                return self
            except sqlite3.OperationalError as err:
                # Inside a transaction a refusal is final (see the module's docstring).
                if not is_busy(err) or self.connection.in_transaction:
                    raise
            tries += 1
            now = time.monotonic()
            if tries == 1:  # the clock is read only once a try is refused: most statements never are
                deadline = now + self.connection.busy_timeout
            left = deadline - now
            if left <= 0:
                raise LockWaitExceeded(
                    f"database is locked: another connection held SQLite's lock for longer than the busy "
                    f"timeout, {self.connection.busy_timeout * 1000:.0f} ms ({self.connection.busy_timeout_setting}); "
                    f"{tries} tries of: {sql[:80]}")
            pause = PAUSES[tries - 1] if tries <= len(PAUSES) else LONGEST_PAUSE
            if pause:
                time.sleep(min(pause, left))
