"""Alembic environment for the durable store; used by ``celery durable migrate`` and first use."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection

from celery_durable.store.schema import VERSION_TABLE, metadata

config = context.config


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=metadata, version_table=VERSION_TABLE,
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=metadata,
                      version_table=VERSION_TABLE, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    # The store hands its own connection in (already inside its migration
    # lock); the CLI without one connects from the URL.
    given = config.attributes.get("connection")
    if given is not None:
        _run(given)
    else:
        url = config.get_main_option("sqlalchemy.url")
        if url is None:  # only store.engine.alembic_config() loads this env, and it always sets one
            raise RuntimeError("the durable store migrations need sqlalchemy.url; run `celery durable migrate`")
        with create_engine(url).begin() as conn:
            _run(conn)
