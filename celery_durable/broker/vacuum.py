"""The broker table's own VACUUM: a claiming worker removes the dead rows its claims and acks leave.

Every claim is an UPDATE and every ack a DELETE, so the table's dead row versions grow by two per
message. Until a VACUUM removes them, each claim walks their index entries: measured
(``benchmarks/PG_BROKER_RESULTS.md``, run H7) one-queue claims went from 275 to 383 µs p50 with 24,000
dead rows behind them. Autovacuum cannot be counted on for that: it looks at a database once a
minute at best (``autovacuum_naptime``), and it may be off (it is on the machine the figures come
from). So each worker process that claims checks the table's dead rows about once a second and
VACUUMs it (``SKIP_LOCKED``: a worker never waits for another's) once ``durable_broker_vacuum_dead_rows``
more have piled up since its last VACUUM.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from sqlalchemy.engine import Engine

from celery_durable.config import DEFAULT_VACUUM_DEAD_ROWS

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_VACUUM_DEAD_ROWS", "TableVacuum", "VacuumPlan", "for_process"]
#: Seconds between two looks at the table's dead rows: one cheap statistics read.
CHECK_INTERVAL = 1.0

TABLE = "durable_broker_messages"

# The table's dead row versions as the statistics system last heard of them (backends report at commit, at
# most about once a second), and whether this role may VACUUM it (owners and superusers may; anyone else's
# VACUUM is a warning that does nothing).
_DEAD_ROWS = f"SELECT coalesce(pg_stat_get_dead_tuples(to_regclass('{TABLE}')), 0)"
_MAY_VACUUM = f"SELECT pg_has_role(c.relowner, 'MEMBER') FROM pg_class AS c WHERE c.oid = to_regclass('{TABLE}')"
_VACUUM = f"VACUUM (SKIP_LOCKED) {TABLE}"


@dataclass(frozen=True)
class VacuumPlan:
    """When a VACUUM is due: ``threshold`` more dead rows than the last VACUUM left (pure).

    Counted from what the last VACUUM left, not from zero: row versions an open transaction may still
    see survive a VACUUM, and a plan counting from zero would VACUUM every second until it ends.
    """

    threshold: int
    left: int = 0

    def due(self, dead_rows: int) -> bool:
        return self.threshold > 0 and dead_rows - self.left >= self.threshold

    def after_vacuum(self, dead_rows_left: int) -> VacuumPlan:
        return VacuumPlan(self.threshold, dead_rows_left)


class TableVacuum:
    """Checks the broker table every ``interval`` seconds on a daemon thread and VACUUMs it when due.

    One per process and database (``for_process``), checking while a connection that holds rows is open
    (``join``/``leave``): a worker's consumer connections share it. A check or
    VACUUM that fails (the database out) is logged and tried again next check; the claims go on meanwhile.
    """

    def __init__(self, engine: Engine, threshold: int, interval: float = CHECK_INTERVAL) -> None:
        # ``engine`` is in autocommit: VACUUM cannot run inside a transaction block.
        self._engine = engine
        self._plan = VacuumPlan(threshold)
        self._interval = interval
        #: Set to end the running checks; None while none run.
        self._stopped: threading.Event | None = None
        self._holders = 0
        self._lock = threading.Lock()
        #: VACUUMs this process made (tests and the benchmark read it).
        self.vacuums = 0

    def join(self) -> None:
        """A connection of this process holds rows: check while any does."""
        with self._lock:
            self._holders += 1
            if self._stopped is None and self._plan.threshold > 0:
                self._stopped = threading.Event()
                threading.Thread(target=self._run, args=(self._stopped,), name="durable-broker-vacuum",
                                 daemon=True).start()

    def leave(self) -> None:
        """A connection that joined closed: the last one out stops the checks (a test's store may be gone next)."""
        with self._lock:
            self._holders = max(0, self._holders - 1)
            if self._holders == 0 and self._stopped is not None:
                self._stopped.set()
                self._stopped = None

    @property
    def checking(self) -> bool:
        with self._lock:
            return self._stopped is not None

    def _run(self, stopped: threading.Event) -> None:
        try:
            if not self._may_vacuum():
                logger.warning(
                    "durable.broker.vacuum_refused: this database role does not own %s and cannot VACUUM it; "
                    "its dead rows wait for autovacuum (set durable_broker_vacuum_dead_rows = 0 to say so)",
                    TABLE, extra={"event": "durable.broker.vacuum_refused"})
                return
        except Exception as err:  # noqa: BLE001 - the check is retried below, one beat at a time
            logger.warning("durable.broker.vacuum_failed: %s", err, extra={"event": "durable.broker.vacuum_failed"})
        while not stopped.wait(self._interval):
            try:
                self.check()
            except Exception as err:  # noqa: BLE001 - the next check tries again; claims go on meanwhile
                logger.warning("durable.broker.vacuum_failed: %s", err,
                               extra={"event": "durable.broker.vacuum_failed"})

    def _may_vacuum(self) -> bool:
        with self._engine.connect() as conn:
            return bool(conn.exec_driver_sql(_MAY_VACUUM).scalar())

    def check(self) -> bool:
        """One look at the table's dead rows, and a VACUUM if they are due one: whether it VACUUMed."""
        with self._engine.connect() as conn:
            dead_rows = int(conn.exec_driver_sql(_DEAD_ROWS).scalar() or 0)
            if not self._plan.due(dead_rows):
                return False
            conn.exec_driver_sql(_VACUUM)
            left = int(conn.exec_driver_sql(_DEAD_ROWS).scalar() or 0)
        self._plan = self._plan.after_vacuum(left)
        self.vacuums += 1
        logger.debug("durable.broker.vacuumed: %d dead rows, %d left", dead_rows, left,
                     extra={"event": "durable.broker.vacuumed"})
        return True


_by_process: dict[tuple[int, str], TableVacuum] = {}
_registry_lock = threading.Lock()


def for_process(engine: Engine, threshold: int) -> TableVacuum:
    """This process's vacuum of ``engine``'s broker table (a forked child starts its own if it claims)."""
    key = (os.getpid(), engine.url.render_as_string(hide_password=False))
    with _registry_lock:
        found = _by_process.get(key)
        if found is None:
            found = _by_process[key] = TableVacuum(engine, threshold)
        return found
