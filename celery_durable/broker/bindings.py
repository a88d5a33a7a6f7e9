"""The broker's bindings that route across processes (``durable_broker_bindings``, migration 0012).

kombu's virtual transports keep bindings in each process's memory: enough for a producer that
declared the queue it sends to, not for a broadcast (``celery inspect`` publishes to a fan-out
exchange only the workers bound), a reply (a worker publishes on a key only the asking client bound)
or a task event (to whichever monitors bound ``celeryev``). Those bindings are rows here, written at
bind, read to route, refreshed by the connection that consumes their queue. A binding whose queue
declared ``x-expires`` lapses once nobody consumed it for that long (a monitor or a worker that died),
and the messages left in its queue go with it — RabbitMQ's rule for such a queue.

Times are seconds since the epoch in the database's clock, so hosts whose clocks disagree agree here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from celery_durable.compat.row_exchanges import Binding, Meta
from celery_durable.store.engine import autocommit

#: The database's clock in epoch seconds, per backend.
_NOW = {
    "postgresql": "extract(epoch from clock_timestamp())",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}

#: Seconds a process reuses what it read of an exchange's topic bindings (a new monitor's first second of
#: events can miss it, as a RabbitMQ queue declared a moment late does). Fan-out and direct misses read anew.
TOPIC_TABLE_MAX_AGE = 1.0


def _now(conn: Connection) -> str:
    return _NOW[conn.dialect.name]


def _upsert(conn: Connection) -> sa.TextClause:
    return sa.text(
        "INSERT INTO durable_broker_bindings (exchange, routing_key, queue, pattern, expires_after, seen_at) "
        f"VALUES (:exchange, :routing_key, :queue, :pattern, :expires_after, {_now(conn)}) "
        "ON CONFLICT (exchange, routing_key, queue) DO UPDATE SET pattern = excluded.pattern, "
        "expires_after = excluded.expires_after, seen_at = excluded.seen_at")


def _params(binding: Binding) -> dict[str, object]:
    return {"exchange": binding.exchange, "routing_key": binding.routing_key, "queue": binding.queue,
            "pattern": binding.pattern, "expires_after": binding.expires_after}


def bind(engine: Engine, binding: Binding) -> None:
    """Record ``binding`` (again: its pattern and expiry replaced, seen now)."""
    with engine.begin() as conn:
        bind_on(conn, binding)


def bind_on(conn: Connection, binding: Binding) -> None:
    """Record ``binding`` in ``conn``'s transaction."""
    conn.execute(_upsert(conn), _params(binding))


def unbind(engine: Engine, queue: str, exchange: str | None = None, routing_key: str | None = None) -> None:
    """Forget the bindings of ``queue`` (all of them, or the one to ``exchange`` under ``routing_key``)."""
    with engine.begin() as conn:
        if exchange is None:
            conn.execute(sa.text("DELETE FROM durable_broker_bindings WHERE queue = :queue"), {"queue": queue})
        else:
            conn.execute(sa.text("DELETE FROM durable_broker_bindings WHERE queue = :queue AND exchange = :exchange "
                                 "AND routing_key = :routing_key"),
                         {"queue": queue, "exchange": exchange, "routing_key": routing_key or ""})


def table(engine: Engine, exchange: str) -> list[Meta]:
    """The live bindings of ``exchange`` as kombu's routing table (lapsed ones left out).

    A read that takes no lock (autocommit: on SQLite no ``BEGIN IMMEDIATE``): a publish routed inside the
    caller's open write transaction (a ``task-sent`` event of ``outbox.enqueue``) must not wait for it."""
    with autocommit(engine).connect() as conn:
        found = conn.execute(sa.text(
            "SELECT routing_key, pattern, queue FROM durable_broker_bindings WHERE exchange = :exchange "
            f"AND (expires_after IS NULL OR seen_at + expires_after > {_now(conn)}) ORDER BY queue"),
            {"exchange": exchange})
        return [(row.routing_key, row.pattern, row.queue) for row in found]


def refresh(engine: Engine, consumed: Sequence[Binding]) -> list[str]:
    """Mark ``consumed`` seen now (recreating any that lapsed while this process was stopped), then drop the
    bindings nobody consumed within their expiry and the messages of queues left unbound; those queues."""
    with engine.begin() as conn:
        if consumed:
            conn.execute(_upsert(conn), [_params(binding) for binding in consumed])
        lapsed = {row.queue for row in conn.execute(sa.text(
            "DELETE FROM durable_broker_bindings WHERE expires_after IS NOT NULL "
            f"AND seen_at + expires_after <= {_now(conn)} RETURNING queue"))}
        if not lapsed:
            return []
        still_bound = {row.queue for row in conn.execute(
            sa.text("SELECT DISTINCT queue FROM durable_broker_bindings WHERE queue IN :queues")
            .bindparams(sa.bindparam("queues", expanding=True)), {"queues": sorted(lapsed)})}
        gone = sorted(lapsed - still_bound)
        if gone:
            conn.execute(sa.text("DELETE FROM durable_broker_messages WHERE queue IN :queues")
                         .bindparams(sa.bindparam("queues", expanding=True)), {"queues": gone})
        return gone


class SharedTables:
    """One connection's reads of the shared routing tables, reused for a moment where staleness is harmless.

    A fan-out publish always reads anew (a worker that bound a second ago must hear the broadcast); a
    direct lookup reads only after this process's own bindings missed (a reply key the asking client
    bound just now); a topic lookup reuses a read younger than ``max_age`` (events are many, monitors few).
    """

    def __init__(self, read: Callable[[str], list[Meta]], max_age: float = TOPIC_TABLE_MAX_AGE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read = read
        self._max_age = max_age
        self._clock = clock
        self._read_at: dict[str, tuple[float, list[Meta]]] = {}

    def get(self, exchange: str, *, fresh: bool) -> list[Meta]:
        now = self._clock()
        cached = self._read_at.get(exchange)
        if not fresh and cached is not None and now - cached[0] < self._max_age:
            return cached[1]
        found = self._read(exchange)
        self._read_at[exchange] = (now, found)
        return found
