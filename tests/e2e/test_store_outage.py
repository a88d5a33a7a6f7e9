"""The durable store going away under real ``-P durable`` workers: no run lost or stranded, no retry spent.

The store is cut through a TCP proxy the test owns (tests/faultproxy.py); the shared
PostgreSQL is never stopped.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import sqlalchemy as sa

from celery_durable.store.engine import engine_for
from tests.e2e.durable_support import (  # noqa: F401 - durable_scenario is a fixture
    APP,
    conf,
    durable_scenario,
    run_state,
)
from tests.e2e.harness import wait_for

OUTAGE_SECONDS = 6.0  # three lease TTLs: every lease held when it began has expired by its end


def ledger_rows(url: str, run_id: str) -> int:
    with engine_for(url).connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM e2e_effects WHERE run_id = :r AND step = 'ledger'"),
                                {"r": run_id}).scalar())


def rows_running(url: str) -> int:
    with engine_for(url).connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM durable_runs WHERE state NOT IN "
                                        "('succeeded', 'dead', 'cancelled')")).scalar())


def unavailable_lines_per_process(log: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for process in re.findall(r"WARNING/([\w-]+)\] durable\.store\.unavailable", log):
        counts[process] = counts.get(process, 0) + 1
    return counts


def outage_conf(proxied_url: str, **extra: Any) -> dict[str, Any]:
    return conf(proxied_url, durable_lease_ttl=2, durable_relay=False, durable_restore_interval=0.3,
                broker_transport_options={"visibility_timeout": 30}, **extra)


@pytest.mark.parametrize("broker_kind", ["redis", "rabbitmq"])
def test_runs_sent_while_the_store_is_down_at_boot_run_once_it_is_back(durable_scenario, fault_proxy,
                                                                        broker_kind):
    s, url = durable_scenario("postgresql", broker_kind)
    proxy = fault_proxy(url)
    proxy.outage()
    worker = s.worker(app=APP, conf=outage_conf(proxy.url_for(url)), concurrency=2).wait_ready()
    ids = [s.send_task("q", "durable.outage_steps", [f"boot-{n}", 0.0]) for n in range(4)]
    wait_for(lambda: "durable.store.unavailable" in worker.log(), timeout=20, what="the outage to be reported")
    # The worker goes on running plain tasks meanwhile.
    plain = [s.send_task("q", "durable.plain", [f"plain-{n}"]) for n in range(3)]
    wait_for(lambda: len(s.labelled("plain", "plain-")) == 3, timeout=20, what="plain tasks during the outage")
    time.sleep(OUTAGE_SECONDS)  # hold the outage open: the runs must wait, not be dropped
    assert not s.labelled("exec", "boot-"), "a body ran while the store was down"
    assert all(run_state(url, run_id) is None for run_id in ids)
    proxy.restore()
    wait_for(lambda: all(run_state(url, run_id) == "succeeded" for run_id in ids), timeout=60,
             what="every run to succeed once the store is back")
    for n, run_id in enumerate(ids):
        assert ledger_rows(url, run_id) == 1
        assert [e["retries"] for e in s.labelled("end", f"boot-{n}")] == [0], "the outage spent a retry"
    # Once per outage for the whole worker, whichever of its processes met it first.
    log = worker.log()
    assert sum(unavailable_lines_per_process(log).values()) == 1, unavailable_lines_per_process(log)
    assert log.count("durable.store.available") == 1
    assert len(plain) == 3 and worker.process.poll() is None
    assert worker.terminate() == 0


@pytest.mark.parametrize("broker_kind", ["redis", "rabbitmq"])
def test_runs_cut_off_mid_step_by_a_store_outage_resume_and_settle(durable_scenario, fault_proxy, broker_kind):
    s, url = durable_scenario("postgresql", broker_kind)
    proxy = fault_proxy(url)
    worker = s.worker(app=APP, conf=outage_conf(proxy.url_for(url)), concurrency=4).wait_ready()
    ids = [s.send_task("q", "durable.outage_steps", [f"mid-{n}", 1.5]) for n in range(4)]
    wait_for(lambda: len(s.labelled("effect", "mid-")) >= 4, timeout=30, what="every run to be inside a step")
    proxy.outage()
    time.sleep(OUTAGE_SECONDS)  # hold the outage open past the leases' TTL
    proxy.restore()
    wait_for(lambda: all(run_state(url, run_id) == "succeeded" for run_id in ids), timeout=90,
             what="every run cut off by the outage to succeed")
    for n, run_id in enumerate(ids):
        # Every step ran exactly once: the transactional one's effects roll back with its checkpoint,
        # and a plain step whose fn had run waits in place for the store to take its checkpoint.
        assert ledger_rows(url, run_id) == 1
        steps = [e["step"] for e in s.labelled("effect", f"mid-{n}")]
        assert sorted(steps) == ["first", "second"], steps
        assert [e["retries"] for e in s.labelled("end", f"mid-{n}")] == [0], "the outage spent a retry"
    assert rows_running(url) == 0
    assert sum(unavailable_lines_per_process(worker.log()).values()) == 1
    wait_for(lambda: [e for e in s.events() if e["e"] == "settled"] and
             len([e for e in s.events() if e["e"] == "settled"]) == 4, timeout=10, what="on_settled per run")
    assert worker.process.poll() is None
    assert worker.terminate() == 0


def test_a_sqlite_store_locked_out_longer_than_its_busy_timeout_loses_no_run(durable_scenario):
    """SQLite's outage: another process holds the write lock past the busy timeout ("database is locked")."""
    import sqlite3

    s, url = durable_scenario("sqlite", "redis")
    worker = s.worker(app=APP, conf=outage_conf(url), concurrency=2).wait_ready()
    path = sa.engine.make_url(url).database
    locker = sqlite3.connect(path, timeout=30, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        ids = [s.send_task("q", "durable.outage_steps", [f"locked-{n}", 0.0]) for n in range(3)]
        wait_for(lambda: "durable.store.unavailable" in worker.log(), timeout=40,
                 what="the locked store to be reported")
        assert not s.labelled("exec", "locked-"), "a body ran while the store was locked"
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    wait_for(lambda: all(run_state(url, run_id) == "succeeded" for run_id in ids), timeout=60,
             what="every run to succeed once the lock is gone")
    for n, run_id in enumerate(ids):
        assert ledger_rows(url, run_id) == 1
        assert [e["retries"] for e in s.labelled("end", f"locked-{n}")] == [0], "the lock spent a retry"
    assert worker.process.poll() is None
    assert worker.terminate() == 0


#: How long the test below holds the store away: many lease renewals, dispatcher rounds and relay passes.
LOGGED_OUTAGE_SECONDS = 10.0


def log_lines(log: str, event: str) -> list[str]:
    return [line for line in log.splitlines() if re.search(rf"\] {re.escape(event)}\b", line)]


@pytest.mark.long
@pytest.mark.parametrize("relay", [True, False], ids=["relay", "no-relay"])
def test_a_store_outage_is_logged_once_when_it_starts_and_once_when_it_ends(durable_scenario, fault_proxy,
                                                                             relay):
    """Every part of the worker that meets the outage (claims of a limited task, its dispatcher and lease
    renewals, durable runs, the relay and its LISTEN) tells the one outage tracker: one warning when it
    starts, naming the error, one when it ends, saying how long it lasted; each failing call at debug."""
    s, url = durable_scenario("postgresql", "redis")
    proxy = fault_proxy(url)
    worker = s.worker(app="tests.e2e.limitsapp", concurrency=2,
                      conf=conf(proxy.url_for(url), durable_lease_ttl=2, durable_relay=relay)).wait_ready()
    # One of each first, so every component holds store connections when the store goes away.
    s.send_task("q", "limits.export", ["pre-x", 0.0])
    s.send_task("q", "limits.stepped", ["pre-d"])
    wait_for(lambda: len(s.labelled("end", "pre-")) == 2, timeout=15,
             what="a limited and a durable run before the outage")
    proxy.outage()
    cut_at = time.monotonic()
    exports = {s.send_task("q", "limits.export", [f"out-x{n}", 0.0]) for n in range(3)}
    durables = {s.send_task("q", "limits.stepped", [f"out-d{n}"]) for n in range(3)}
    wait_for(lambda: log_lines(worker.log(), "durable.store.unavailable"), timeout=LOGGED_OUTAGE_SECONDS,
             what="the outage to be reported")
    time.sleep(max(0.0, cut_at + LOGGED_OUTAGE_SECONDS - time.monotonic()))  # hold the outage open
    assert not s.labelled("start", "out-x"), "a limited run started while the store could not count it"
    proxy.restore()
    wait_for(lambda: {e["id"] for e in s.labelled("end", "out-x")} == exports
             and {e["id"] for e in s.labelled("end", "out-d")} == durables, timeout=30,
             what="every run sent during the outage to end once the store is back")
    wait_for(lambda: log_lines(worker.log(), "durable.store.available"), timeout=10,
             what="the end of the outage to be reported")
    log = worker.log()
    down, up = log_lines(log, "durable.store.unavailable"), log_lines(log, "durable.store.available")
    assert len(down) == 1 and len(up) == 1, down + up
    # The failing calls were told at debug (not shown at -l info): no traceback, no failure line.
    failures = [line for line in log.splitlines() if re.search(r"(WARNING|ERROR)/.*_(failed|unavailable)\b", line)
                and "durable.store.unavailable" not in line]
    assert failures == [] and "Traceback" not in log, failures[:3] + [f"{log.count('Traceback')} tracebacks"]
    assert re.search(r"WARNING/.* error=OperationalError: .*(refused|closed the connection)", down[0]), down
    lasted = re.search(r"lasted=([\d.]+)s", up[0])
    assert lasted and LOGGED_OUTAGE_SECONDS - 2 <= float(lasted.group(1)) <= LOGGED_OUTAGE_SECONDS + 15, up
    assert worker.terminate() == 0
