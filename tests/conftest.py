from __future__ import annotations

import pytest

from tests.services import broker_url


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(kind, url) of each real broker; the test runs once per broker."""
    return request.param, broker_url(request.param)
