from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.faultproxy import FaultProxy
from tests.services import broker_url

#: Of each failed e2e test's process logs, the last lines repeated at the very end of the run: the tail
#: of CI's output is what is kept of it, and the failures' own sections scroll out of it.
DIGEST_LINES_PER_LOG = 6
DIGEST_LINE_CHARS = 220


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from tests.e2e.harness import E2E_LOG_SECTION

    failed = terminalreporter.stats.get("failed", [])
    tails = [(report.nodeid, title, text) for report in failed for title, text in report.sections
             if title.startswith(E2E_LOG_SECTION)]
    if not tails:
        return
    terminalreporter.section("last lines of the failed e2e tests' process logs", sep="-")
    for nodeid, title, text in tails:
        terminalreporter.write_line(f"{nodeid} :: {title.removeprefix(E2E_LOG_SECTION).strip()}")
        for line in text.splitlines()[-DIGEST_LINES_PER_LOG:]:
            terminalreporter.write_line("  " + line[:DIGEST_LINE_CHARS])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``long`` (15 s or more each) go first: under ``--dist worksteal`` (pyproject.toml) the
    short ones fill in around them, instead of one process running a minute-long test alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


#: Every broker kind: a file opts in to the PostgreSQL broker with
#: ``pytestmark = pytest.mark.parametrize("broker", ALL_BROKERS, indirect=True)``.
#: Every broker the core e2e files run on: Redis, RabbitMQ, and the broker that claims rows on PostgreSQL
#: and on SQLite.
ALL_BROKERS = ["redis", "rabbitmq", "postgresql", "sqlite"]


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(kind, url) of each real broker; the test runs once per broker.

    ``postgresql`` / ``sqlite``: the broker that claims rows (``durable+…``) on a fresh schema or file of
    its own, which the durable store of its workers shares (no ``durable_database_url`` needed).
    """
    if request.param == "sqlite":
        from celery_durable.broker import register
        from tests.stores import fresh_store

        register()
        with fresh_store("sqlite", tmp_path) as url:
            yield "sqlite", f"durable+{url}"
        return
    if request.param != "postgresql":
        yield request.param, broker_url(request.param)
        return
    from celery_durable.broker import register
    from tests.services import OBSERVE_URL, postgres_problem, redis_problem, require
    from tests.stores import fresh_store

    require("PostgreSQL", postgres_problem())
    require("Redis (observation)", redis_problem(OBSERVE_URL))
    register()  # the test process's producer resolves durable+ too
    with fresh_store("postgresql", tmp_path) as url:
        yield "postgresql", f"durable+{url}"


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
