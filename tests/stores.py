"""A fresh durable store per test on each database: a PostgreSQL schema of its own, or a SQLite file.

`fresh_database` gives a PostgreSQL database of its own, for a test whose outcome another test's open
transaction in the shared database would change (what VACUUM may remove).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import sqlalchemy as sa

from tests.services import postgres_url

KINDS = ("postgresql", "sqlite")


@contextmanager
def fresh_store(kind: str, tmp_dir: Path) -> Iterator[str]:
    """Yields the URL of an empty store; the PostgreSQL schema is dropped afterwards."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_dir / f'durable-{uuid.uuid4().hex[:8]}.sqlite'}"
        return
    base = postgres_url()
    schema = f"durable_t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    try:
        # search_path per connection: the store's unqualified table names land in this schema.
        yield f"{base}?options={quote(f'-csearch_path={schema}')}"
    finally:
        from celery_durable.store.engine import dispose_all

        dispose_all()
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
        admin.dispose()


@contextmanager
def fresh_database() -> Iterator[str]:
    """Yields the URL of an empty PostgreSQL database of its own; dropped afterwards.

    A VACUUM keeps every row version an open transaction of the same database may still see, and
    under ``-n 2`` the other test process's transactions run in the shared database: only a test in
    a database of its own sees what its VACUUM removes.
    """
    base = sa.engine.make_url(postgres_url())
    name = f"durable_t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        from celery_durable.store.engine import dispose_all

        dispose_all()
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE {name} WITH (FORCE)")
        admin.dispose()
