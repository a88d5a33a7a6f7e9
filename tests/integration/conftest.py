from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_durable.broker import register
from celery_durable.store.engine import ensure_schema
from tests.stores import KINDS, fresh_store


@pytest.fixture(params=KINDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty durable store; every test using it runs once on PostgreSQL and once on SQLite."""
    with fresh_store(request.param, tmp_path) as url:
        yield url


@pytest.fixture
def broker_db(store_url: str) -> str:
    """``store_url`` made ready for the broker that claims rows (schema made, ``durable+`` registered here)."""
    register()
    ensure_schema(store_url)
    return store_url


@pytest.fixture
def user_engine(store_url: str) -> Iterator[sa.engine.Engine]:
    """The caller's own engine on the durable database (not celery_durable's), its schema made."""
    ensure_schema(store_url)
    engine = sa.create_engine(store_url)
    yield engine
    engine.dispose()
