from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from tests.e2e.harness import Scenario
from tests.faultproxy import FaultProxy


@pytest.fixture
def scenario(broker: tuple[str, str], fault_proxy: Callable[[str], FaultProxy]
             ) -> Iterator[Callable[..., Scenario]]:
    """Makes a Scenario on this test's broker; cleans up its workers, queues and events.

    ``scenario(names, proxied=True)``: its workers and producer reach the broker through a
    FaultProxy of the test's own (``s.proxy``), torn down after the scenario is cleaned up.
    """
    made: list[Scenario] = []

    def make(queue_names: Sequence[str], *, proxied: bool = False) -> Scenario:
        proxy = fault_proxy(broker[1]) if proxied else None
        s = Scenario(broker[0], proxy.url_for(broker[1]) if proxy else broker[1], queue_names, proxy=proxy)
        made.append(s)
        return s

    yield make
    for s in made:
        s.cleanup()
