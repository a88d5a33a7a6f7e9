"""Engines for the durable store, one per (process, URL), and the schema check and migration on first use."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from celery_durable.errors import SchemaOutdated, StoreUnavailable
from celery_durable.store.driver_sql import AUTOCOMMIT_OPTION
from celery_durable.store.schema import HEAD_REVISION, VERSION_TABLE
from celery_durable.store.sqlite_lock_wait import LockWaitingConnection
from celery_durable.store.unreachable import CONNECTION_ERRORS
from celery_durable.store.urls import broker_database, rendered, shown_url

#: Where the store lives when ``durable_database_url`` is not set: a file in the working directory.
DEFAULT_URL = "sqlite:///durable.sqlite"

#: Milliseconds a SQLite writer waits for another process's lock before failing (``sqlite_lock_wait``).
SQLITE_BUSY_TIMEOUT_MS = 10_000

MIGRATIONS = Path(__file__).resolve().parent / "migrations"

# Keyed by pid: a prefork child inherits its parent's dict, and must not use
# the sockets (or SQLite handles) the parent opened.
_engines: dict[tuple[int, str], Engine] = {}
#: Engines whose connections are in autocommit from the start (see ``autocommit``).
_autocommit_engines: dict[tuple[int, str], Engine] = {}
#: PostgreSQL engines in autocommit whose commits do not wait for the WAL flush (see ``lazy_commit``).
_lazy_engines: dict[tuple[int, str], Engine] = {}
_checked: set[tuple[int, str]] = set()
_lock = threading.Lock()


def store_url(app: Any) -> str:
    """The durable store URL of a Celery app: ``durable_database_url``, else the database of a
    ``durable+<url>`` broker (one database for both), else the default SQLite file."""
    return resolve_url(app.conf.get("durable_database_url") or broker_database(app.conf.get("broker_url")))


def resolve_url(url: str | None) -> str:
    """The URL as the store uses it; a relative SQLite path is fixed to the working directory now."""
    return _resolve(url or DEFAULT_URL, os.getcwd())


def database_identity(url: sa.engine.URL | str) -> tuple[Any, ...]:
    """What makes two URLs the same database: driver and password do not; host, name and options do."""
    if isinstance(url, str):
        return _identity(url, os.getcwd())
    # An engine keeps one URL object for life, and hashing a URL renders it as a string: by object.
    seen = _URL_IDENTITIES.get(id(url))
    if seen is None or seen[0] is not url:
        seen = _URL_IDENTITIES[id(url)] = (url, _identity(url.render_as_string(hide_password=False), os.getcwd()))
        if len(_URL_IDENTITIES) > 256:
            _URL_IDENTITIES.clear()  # a process makes few engines: more is a leak to cut, not a working set
    return seen[1]


_URL_IDENTITIES: dict[int, tuple[sa.engine.URL, tuple[Any, ...]]] = {}


@functools.lru_cache(maxsize=256)
def _identity(url: str, cwd: str) -> tuple[Any, ...]:
    # Cached: an enqueue on the PostgreSQL broker compares its connection's database with the
    # broker's and the store's, and parsing is the whole cost (``cwd``: a relative SQLite path's base).
    parsed = sa.engine.make_url(resolve_url(url))
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return (backend, parsed.database)
    # ``options`` can carry a search_path: another schema is another set of tables.
    return (backend, parsed.host or "localhost", parsed.port or 5432, parsed.database, parsed.username,
            tuple(sorted((k, str(v)) for k, v in parsed.query.items())))


@functools.lru_cache(maxsize=64)
def _resolve(url: str, cwd: str) -> str:
    # Cached: every run, enqueue and relay pass resolves the app's URL, and parsing it is
    # the only cost; the working directory is part of the key, as a relative path depends on it.
    parsed = sa.engine.make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        path = Path(parsed.database)
        if not path.is_absolute():
            url = parsed.set(database=str(Path(cwd) / path)).render_as_string(hide_password=False)
    return url


def store_exists(url: str) -> bool:
    """False only for a SQLite file not created yet (a reader must not create it just to find it empty)."""
    parsed = sa.engine.make_url(resolve_url(url))
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return True
    return Path(parsed.database).exists()


def _sqlite_engine(url: str, *, autocommit: bool = False) -> Engine:
    # autocommit: set once per connection, at connect. An isolation level set per checkout is reset
    # on each return by SQLite's PRAGMA read_uncommitted, which expires every statement the
    # connection had prepared: each run compiled its five statements again (~0.5 ms a run).
    isolation = {"isolation_level": "AUTOCOMMIT"} if autocommit else {}
    # timeout=0: no SQLite busy handler, whose first sleep is 1 ms for a lock another process holds
    # for microseconds; the connection waits in short steps itself, within the same busy timeout.
    engine = sa.create_engine(url, connect_args={"timeout": 0, "factory": LockWaitingConnection,
                                                 "check_same_thread": False}, **isolation)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # pysqlite's own implicit BEGIN is deferred (a later write can fail
        # busy without waiting); we issue BEGIN IMMEDIATE ourselves below.
        dbapi_conn.isolation_level = None
        # The busy timeout first: switching to WAL needs a moment with no other
        # writer (another process's transaction), and waits for it instead of failing.
        dbapi_conn.busy_timeout = SQLITE_BUSY_TIMEOUT_MS / 1000
        cursor = dbapi_conn.cursor()
        # WAL: readers never block the one writer, so threads and processes share the file.
        cursor.execute("PRAGMA journal_mode=WAL")
        # NORMAL is durable across a process crash in WAL mode (only an OS crash can lose the tail).
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    if autocommit:
        return engine

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


#: libpq settings for every PostgreSQL connection of the store, unless its URL gives its own: a
#: database host that is lost (no RST ever comes) fails the statement waiting on it within about
#: 20 s, reported and retried like any outage, instead of stalling that thread — the worker's
#: claim loop among them — for the kernel's default of hours.
PG_NETWORK_TIMEOUTS = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 3,
                       "keepalives_count": 3, "tcp_user_timeout": 20_000}


def network_timeouts(url: str) -> dict[str, Any]:
    """The connect arguments bounding a lost PostgreSQL host, for libpq drivers (psycopg 2 and 3)."""
    parsed = sa.engine.make_url(url)
    if parsed.get_backend_name() != "postgresql" or parsed.get_driver_name() not in ("psycopg2", "psycopg"):
        return {}
    return {name: value for name, value in PG_NETWORK_TIMEOUTS.items() if name not in parsed.query}


def engine_for(url: str | None) -> Engine:
    """This process's engine for ``url``, created on first use."""
    url = resolve_url(url)
    key = (os.getpid(), url)
    engine = _engines.get(key)
    if engine is None:
        with _lock:
            engine = _engines.get(key)
            if engine is None:
                if sa.engine.make_url(url).get_backend_name() == "sqlite":
                    engine = _sqlite_engine(url)
                else:
                    engine = sa.create_engine(url, pool_pre_ping=False, connect_args=network_timeouts(url))
                _engines[key] = engine
    return engine


def autocommit(engine: Engine) -> Engine:
    """An engine whose every statement is its own transaction: a checkpoint INSERT is one round trip.

    A pool of its own whose connections are in autocommit from the start: the
    same pool switched per checkout would set and reset the isolation level on
    every use (on SQLite that reset expires the connection's prepared statements).
    An in-memory SQLite database is one per connection: there, the same pool.
    """
    if engine.dialect.name == "sqlite" and engine.url.database in (None, "", ":memory:"):
        return engine.execution_options(isolation_level="AUTOCOMMIT")
    url = rendered(engine.url)
    key = (os.getpid(), url)
    found = _autocommit_engines.get(key)
    if found is None:
        with _lock:
            found = _autocommit_engines.get(key)
            if found is None:
                if engine.dialect.name == "sqlite":
                    found = _sqlite_engine(url, autocommit=True)
                else:
                    found = sa.create_engine(url, isolation_level="AUTOCOMMIT", pool_pre_ping=False,
                                             connect_args=network_timeouts(url))
                # Its connections are in autocommit from the start: a run's hot statements may skip
                # SQLAlchemy's execution (store/driver_sql.py).
                found.update_execution_options(**{AUTOCOMMIT_OPTION: True})
                _autocommit_engines[key] = found
                _share_disconnects(engine, found)
    return found


def lazy_commit(engine: Engine) -> Engine:
    """``autocommit`` whose commits do not wait for the WAL flush (``synchronous_commit = off``), PostgreSQL only.

    For statements whose loss in a database crash is harmless and redone (the
    broker's claims, acks and lease renewals: a claim forgotten leaves its
    row ready; an ack or a renewal forgotten hands the row out again once its
    lease lapses, at least once as on every broker), and a transient publish
    (``delivery_mode`` 1: Celery's task events and remote-control messages, which
    RabbitMQ keeps in memory only). Never for a persistent publish or a
    checkpoint. Waiting for the flush is most of a one-row DELETE's cost.
    """
    url = rendered(engine.url)
    key = (os.getpid(), url)
    found = _lazy_engines.get(key)
    if found is None:
        with _lock:
            found = _lazy_engines.get(key)
            if found is None:
                found = sa.create_engine(url, isolation_level="AUTOCOMMIT", pool_pre_ping=False,
                                         connect_args=network_timeouts(url))

                @event.listens_for(found, "connect")
                def _no_flush_wait(dbapi_conn: Any, _record: Any) -> None:
                    cursor = dbapi_conn.cursor()
                    try:
                        cursor.execute("SET synchronous_commit TO off")
                    finally:
                        cursor.close()

                _lazy_engines[key] = found
                _share_disconnects(engine, found)
    return found


def _share_disconnects(one: Engine, other: Engine) -> None:
    """Two pools to one database drop their idle connections together.

    A disconnect met on one engine makes SQLAlchemy drop that engine's whole
    pool (its other connections died with the same server or link); the
    sibling's idle connections died too, and would each fail once more after
    the database is back — a second outage report for one outage.
    """
    for engine, sibling in ((one, other), (other, one)):
        def drop_sibling(context: Any, sibling: Engine = sibling) -> None:
            if context.is_disconnect:
                sibling.dispose(close=False)

        sa.event.listen(engine, "handle_error", drop_sibling)


def dispose_all() -> None:
    """Close this process's engines (tests, and a benchmark between databases)."""
    with _lock:
        for made in (_autocommit_engines, _lazy_engines):
            for key, engine in list(made.items()):
                if key[0] == os.getpid():
                    engine.dispose()
                    del made[key]
        for (pid, url), engine in list(_engines.items()):
            if pid == os.getpid():
                engine.dispose()
                del _engines[(pid, url)]
                _checked.discard((pid, url))


@contextmanager
def unavailable_as_error(url: str) -> Iterator[None]:
    """Turn "cannot reach the database" into StoreUnavailable (a DurableError the task retries on)."""
    try:
        yield
    except CONNECTION_ERRORS as err:
        raise StoreUnavailable(f"the durable store at {shown_url(url)} is unavailable: "
                               f"{str(err.orig or err).strip().splitlines()[0]}") from err


def alembic_config(url: str, connection: Connection | None = None) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser interpolation would eat a % in a password.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def current_revision(conn: Connection) -> str | None:
    if not sa.inspect(conn).has_table(VERSION_TABLE):
        return None
    return conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()


def _lock_migrations(conn: Connection) -> None:
    # Two workers starting on a fresh database must not both create the tables.
    # SQLite: the BEGIN IMMEDIATE of this transaction already serialises them.
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7296301)")


def migrate(url: str | None) -> tuple[str | None, str]:
    """Upgrade the store at ``url`` to the code's revision; returns (before, after)."""
    from alembic import command

    url = resolve_url(url)
    engine = engine_for(url)
    with unavailable_as_error(url), engine.begin() as conn:
        _lock_migrations(conn)
        before = current_revision(conn)
        if before != HEAD_REVISION:
            command.upgrade(alembic_config(url, conn), "head")
    _checked.add((os.getpid(), url))
    return before, HEAD_REVISION


def ensure_schema(url: str | None) -> Engine:
    """The engine for ``url`` with its schema at the code's revision, checked once per process.

    A database with no durable tables is migrated here (a fresh store works on
    first use); one at another revision is refused: production users migrate
    with ``celery -A proj durable migrate``.
    """
    url = resolve_url(url)
    engine = engine_for(url)
    key = (os.getpid(), url)
    if key in _checked:
        return engine
    with unavailable_as_error(url):
        with engine.connect() as conn:
            fresh = _is_fresh(conn, url)
        if fresh:
            migrate(url)
    _checked.add(key)
    return engine


def ensure_schema_in(conn: Connection, url: str | None) -> None:
    """``ensure_schema`` through the caller's connection, inside the caller's transaction.

    For ``outbox.enqueue``: its caller may already hold the database's write
    lock (SQLite: any INSERT of theirs), so a second connection of ours would
    wait on that lock until the caller's transaction ends, which it cannot do
    before enqueue returns. A fresh store is migrated in the caller's
    transaction: it commits with their row, or rolls back with it (then it is
    not counted as checked).
    """
    from alembic import command

    url = resolve_url(url)
    key = (os.getpid(), url)
    if key in _checked:
        return
    with unavailable_as_error(url):
        if _is_fresh(conn, url):
            _lock_migrations(conn)
            command.upgrade(alembic_config(url, conn), "head")
            return
    _checked.add(key)


def _is_fresh(conn: Connection, url: str) -> bool:
    """True for a database with no durable tables yet (to migrate), False for one at the code's
    revision; any other revision is refused with the command that migrates it."""
    found = current_revision(conn)
    if found is None and not sa.inspect(conn).has_table("durable_runs"):
        return True
    if found != HEAD_REVISION:
        raise SchemaOutdated(
            f"the durable store at {shown_url(url)} is at schema revision {found or 'none (unversioned)'}; "
            f"this code needs {HEAD_REVISION}: run `celery -A proj durable migrate`"
        )
    return False
