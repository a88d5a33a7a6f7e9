from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.faultproxy import FaultProxy
from tests.services import broker_url


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``long`` (15 s or more each) go first: under ``--dist worksteal`` (pyproject.toml) the
    short ones fill in around them, instead of one process running a minute-long test alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(kind, url) of each real broker; the test runs once per broker."""
    return request.param, broker_url(request.param)


@pytest.fixture
def fault_proxy() -> Iterator[Callable[[str], FaultProxy]]:
    """Makes a FaultProxy in front of the service a URL names (``proxy.url_for(url)`` goes through
    it); every proxy made is closed at teardown, its connections cut and its thread joined."""
    made: list[FaultProxy] = []

    def make(url: str) -> FaultProxy:
        proxy = FaultProxy.for_url(url)
        made.append(proxy)
        return proxy

    yield make
    for proxy in made:
        proxy.close()
