from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from tests.e2e.harness import Scenario


@pytest.fixture
def scenario(broker: tuple[str, str]) -> Iterator[Callable[[Sequence[str]], Scenario]]:
    """Makes a Scenario on this test's broker; cleans up its workers, queues and events."""
    made: list[Scenario] = []

    def make(queue_names: Sequence[str]) -> Scenario:
        s = Scenario(broker[0], broker[1], queue_names)
        made.append(s)
        return s

    yield make
    for s in made:
        s.cleanup()
