"""Statements and round trips to the durable store per run, counted in this process with SQLAlchemy events.

A round trip is one request the client waits on:

- every statement (``before_cursor_execute``), clock reads included;
- on PostgreSQL, psycopg2's implicit ``BEGIN``: a connection that is not in
  autocommit sends ``BEGIN`` as a request of its own (a separate exchange, seen
  with strace) before the first statement of each transaction;
- every ``COMMIT`` and ``ROLLBACK`` that reaches the server: one on a connection
  in a transaction. On an autocommit connection (psycopg2 ``autocommit``,
  pysqlite outside a transaction) the driver returns without sending anything,
  so SQLAlchemy's commit and the pool's reset-on-return cost nothing and are not
  counted.

SQLite has no wire, but each statement is still a call into the library that
takes and releases the file's lock: the same count says what it costs.

The cache figures say whether SQLAlchemy compiled a statement again
(``CACHE_MISS``) or reused its compiled form (``CACHE_HIT``); a textual
statement run with ``exec_driver_sql`` has no compiled form (``no cache``).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.engine.default import DefaultExecutionContext

from celery_durable.store.attempt_sql import START_WITHOUT_FLUSH_WAIT

_WRITES = frozenset({"INSERT", "UPDATE", "DELETE"})
#: psycopg2's ``TRANSACTION_STATUS_IDLE``: no transaction open, so a non-autocommit statement sends BEGIN first.
_PG_IDLE = 0


@dataclass
class Tally:
    statements: int = 0
    begins: int = 0
    commits: int = 0
    rollbacks: int = 0
    cache: Counter[str] = field(default_factory=Counter)
    sql: list[str] = field(default_factory=list)
    #: PostgreSQL commits that wait for the WAL flush: a write in autocommit, or a transaction's COMMIT. Every
    #: store write of a run waits for it but its start's (led by attempt_sql.START_WITHOUT_FLUSH_WAIT).
    flush_waits: int = 0

    @property
    def round_trips(self) -> int:
        return self.statements + self.begins + self.commits + self.rollbacks


def _in_transaction(dbapi_conn: Any) -> bool:
    if hasattr(dbapi_conn, "autocommit") and hasattr(dbapi_conn, "info"):  # psycopg2
        return not dbapi_conn.autocommit and dbapi_conn.info.transaction_status != _PG_IDLE
    return bool(getattr(dbapi_conn, "in_transaction", False))  # pysqlite


@contextmanager
def counting() -> Iterator[Tally]:
    """Count every statement and server round trip of every engine in this process until the block ends."""
    tally = Tally()

    def on_execute(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        dbapi = conn.connection.dbapi_connection
        if (hasattr(dbapi, "autocommit") and hasattr(dbapi, "info") and not dbapi.autocommit
                and dbapi.info.transaction_status == _PG_IDLE):
            tally.begins += 1
        tally.statements += 1
        # A PostgreSQL start's message leads with SET LOCAL synchronous_commit: its commit does not wait.
        lazy = statement.startswith(START_WITHOUT_FLUSH_WAIT)
        body = statement.removeprefix(START_WITHOUT_FLUSH_WAIT)
        if hasattr(dbapi, "autocommit") and hasattr(dbapi, "info") and dbapi.autocommit and not lazy \
                and body.lstrip().split(None, 1)[0].upper() in _WRITES:
            tally.flush_waits += 1
        tally.sql.append(" ".join(body.split()[:3]).rstrip(",") + (" (no flush wait)" if lazy else ""))
        compiled = isinstance(context, DefaultExecutionContext) and context.compiled is not None
        tally.cache[context.cache_hit.name if compiled else "no cache"] += 1

    def on_commit(conn: Any) -> None:
        dbapi = conn.connection.dbapi_connection
        if _in_transaction(dbapi):
            tally.commits += 1
            tally.flush_waits += hasattr(dbapi, "autocommit")  # psycopg2: a transaction's COMMIT (read-only ones too)

    def on_rollback(conn: Any) -> None:
        if _in_transaction(conn.connection.dbapi_connection):
            tally.rollbacks += 1

    hooks: list[tuple[str, Callable[..., None]]] = [
        ("before_cursor_execute", on_execute), ("commit", on_commit), ("rollback", on_rollback)]
    for name, fn in hooks:
        event.listen(Engine, name, fn)
    try:
        yield tally
    finally:
        for name, fn in hooks:
            event.remove(Engine, name, fn)


def per_run(app: Any, task: Any, url: str, runs: int = 50) -> dict[str, Tally]:
    """Count ``task`` (three steps) through the real run path, applied in this process against ``url``.

    ``new``: a run seen for the first time, delivered as a worker's pool
    child runs it (Celery's tracer, not eager: a message holds it). ``new, eager``: the same through ``apply()``.
    ``resumed``: a run whose attempt died after its three checkpoints (its
    lease expired), taken over by its retry (``retries=1``), which replays
    the steps and settles.
    """
    from celery.app.trace import build_tracer

    from celery_durable.leases.keeper import new_token
    from celery_durable.planning.checkpoints import StepKey
    from celery_durable.store import runs as store_runs
    from celery_durable.store import steps
    from celery_durable.store.engine import autocommit, ensure_schema

    app.conf.durable_database_url = url
    engine = ensure_schema(url)
    task.apply(args=["warm-up", 0], task_id=uuid.uuid4().hex)  # the first statements compile once per process
    figures: dict[str, Tally] = {}
    tracer = build_tracer(task.name, task, eager=False, propagate=True, app=app)
    delivered = {"delivery_info": {"routing_key": "celery"}, "is_eager": False, "timelimit": (None, None)}
    warm_id = uuid.uuid4().hex
    tracer(warm_id, ["warm-up", 0], {}, {**delivered, "id": warm_id})
    with counting() as tally:
        for i in range(runs):
            task_id = uuid.uuid4().hex
            tracer(task_id, ["count", i], {}, {**delivered, "id": task_id})
    figures["new"] = tally
    with counting() as tally:
        for i in range(runs):
            task.apply(args=["count", i], task_id=uuid.uuid4().hex)
    figures["new, eager"] = tally
    crashed = []
    with autocommit(engine).connect() as conn:
        for i in range(runs + 1):
            run_id, token = uuid.uuid4().hex, new_token()
            store_runs.begin_attempt(conn, run_id=run_id, task_name=task.name, queue=None, args=f'["count",{i}]',
                                     kwargs="{}", token=token, lease_seconds=-timedelta(minutes=5).total_seconds())
            for name in "abc":
                steps.insert(conn, run_id, StepKey(name, 0), str(i), token)
            crashed.append(run_id)
    task.apply(args=["count", 0], task_id=crashed.pop(), retries=1)
    with counting() as tally:
        for i, run_id in enumerate(crashed):
            task.apply(args=["count", i], task_id=run_id, retries=1)
    figures["resumed"] = tally
    return figures
