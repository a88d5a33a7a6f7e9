from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stores import KINDS, fresh_store


@pytest.fixture(params=KINDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty durable store; every test using it runs once on PostgreSQL and once on SQLite."""
    with fresh_store(request.param, tmp_path) as url:
        yield url
