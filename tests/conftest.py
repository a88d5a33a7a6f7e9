"""Fixtures every test folder shares, and which brokers each end-to-end test runs on.

CI must finish in under 30 minutes (.ci/run), with room for another broker: only the core e2e files
(CORE_E2E_FILES) — claim, run, ack, recovery and outage semantics, which differ per broker transport — run
on every broker with a server of its own (MESSAGE_BROKERS), and their tests that opt in on the rows brokers
too (ALL_BROKERS). Every other test taking ``broker`` runs on DEFAULT_BROKER, unless it names the transport
whose own path it tests, or lists brokers whose variants prove something distinct. A new broker is added to
MESSAGE_BROKERS (or ROW_BROKERS) once. Contributors: docs/testing.md, "The project's own tests".
"""

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


#: The brokers with a server of their own beside the store. Their claim, ack and recovery paths differ (Redis:
#: our claim script, held sets and restore by liveness; RabbitMQ: basic.get, and requeue when a connection
#: drops), so the core e2e files run on each. A third such broker is added here, once.
MESSAGE_BROKERS = ["redis", "rabbitmq"]
#: The broker that claims rows (``durable+…``) on PostgreSQL and on SQLite.
ROW_BROKERS = ["postgresql", "sqlite"]
#: Every broker kind: a core file's tests of claim/run/ack/recovery opt in with
#: ``@pytest.mark.parametrize("broker", ALL_BROKERS, indirect=True)``.
ALL_BROKERS = [*MESSAGE_BROKERS, *ROW_BROKERS]
#: The one broker a test of any other file runs on (the ``broker`` fixture's only parameter): Redis, where
#: most of our own transport code is (the claim script, held sets, the idle wait, restoring a dead holder's
#: messages). A test about another transport's own path names it (``parametrize("broker", ["rabbitmq"],
#: indirect=True)``); a test whose per-broker variants prove something distinct lists them.
DEFAULT_BROKER = "redis"

#: The core e2e files: claim/run/ack/recovery/outage semantics that differ per broker transport. Their tests
#: taking ``broker`` run on every MESSAGE_BROKERS unless they list their own brokers (then usually
#: ALL_BROKERS), and their ``broker_kind`` lists are MESSAGE_BROKERS: a new broker joins them here. Every other
#: e2e file runs on DEFAULT_BROKER (CI's wall time: .ci/run, docs/testing.md#the-projects-own-tests).
CORE_E2E_FILES = (
    "test_broker_outage.py",  # claiming resumes after an outage cut the worker off mid-run
    "test_durable_tasks.py",  # a killed run resumes at its checkpoint, a duplicate is a no-op
    "test_expired_tasks.py",  # an expiry while every slot is busy ends REVOKED (RabbitMQ's TTL path)
    "test_fairness_and_cap.py",  # strict turns across queues, the cap, nothing prefetched
    "test_isolation_and_recovery.py",  # per-queue slots, redelivery of a killed worker's run, the drain
    "test_killed_worker_recovery.py",  # a killed worker's runs finish within 2 lease TTLs
    "test_poison.py",  # an unreadable message is parked, the worker runs on
    "test_reconnect.py",  # runs waiting at a lost connection come back with their counts
    "test_run_leases.py",  # a live run is never run twice; a dead holder's run is taken over
)


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A core file's test that takes ``broker`` and names no brokers of its own runs on every MESSAGE_BROKERS.

    Added as a mark before pytest's own hooks read the marks, so the ``broker`` fixture's single default
    parameter gives way to it (as it does to a test's own ``parametrize("broker", …)``)."""
    if "broker" not in metafunc.fixturenames or Path(metafunc.definition.path).name not in CORE_E2E_FILES:
        return
    if any("broker" in _parametrized_names(mark) for mark in metafunc.definition.iter_markers("parametrize")):
        return
    metafunc.definition.add_marker(pytest.mark.parametrize("broker", MESSAGE_BROKERS, indirect=True))


def _parametrized_names(mark: pytest.Mark) -> list[str]:
    names = mark.args[0] if mark.args else mark.kwargs["argnames"]
    if isinstance(names, str):
        return [name.strip() for name in names.split(",")]
    return list(names)


@pytest.fixture(params=[DEFAULT_BROKER])
def broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(kind, url) of this test's broker: DEFAULT_BROKER, every MESSAGE_BROKERS in a core file, or what the test
    names with ``parametrize("broker", […], indirect=True)``.

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
