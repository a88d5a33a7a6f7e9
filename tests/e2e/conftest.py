from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from celery_durable.broker import register
from tests.e2e.harness import E2E_LOG_SECTION, STARTED_LOGS, Scenario
from tests.faultproxy import FaultProxy
from tests.stores import fresh_store


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


@pytest.fixture(params=["postgresql", "sqlite"])
def row_broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Scenario]:
    """A scenario on the broker that claims rows (``durable+``), whose database (and durable store) is a fresh
    PostgreSQL schema or SQLite file; queues ``a``, ``b``, ``c``."""
    register()  # the producer's own process resolves durable+ too
    with fresh_store(request.param, tmp_path) as url:
        s = Scenario("durable", f"durable+{url}", ["a", "b", "c"])
        try:
            yield s
        finally:
            s.cleanup()


#: Lines of each process's log attached to a failed test's report (the whole log stays in E2E_LOG_DIR).
LOG_TAIL_LINES = 80


@pytest.fixture(autouse=True)
def _logs_of_this_test() -> Iterator[None]:
    STARTED_LOGS.clear()
    yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed e2e test's report carries the last lines of every process it started: what CI prints is
    all there is of a run on a fresh checkout, and a worker's log is most of why a test failed."""
    report = yield
    if report.failed:
        for path in STARTED_LOGS:
            try:
                lines = path.read_text(errors="replace").splitlines()
            except OSError as err:
                lines = [f"(unreadable: {err})"]
            report.sections.append((f"{E2E_LOG_SECTION} {path.name}", "\n".join(lines[-LOG_TAIL_LINES:])))
    return report
