"""PostgreSQL, as broker and store at once, cut for 20 s through the test's own proxy (tests/faultproxy.py; the
shared server is never restarted) under a flood of durable runs: no message lost, each run's on_settled hook
called exactly once, the same worker processes carry on once it is back."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import sqlalchemy as sa

from celery_durable.store.engine import engine_for
from tests.e2e.durable_support import APP, conf, durable_scenario, run_state  # noqa: F401 - fixture
from tests.e2e.harness import Scenario, wait_for

CUT_SECONDS = 20.0


def _ledgers(url: str) -> Counter[str]:
    with engine_for(url).connect() as conn:
        return Counter(r[0] for r in conn.execute(sa.text("SELECT run_id FROM e2e_effects WHERE step = 'ledger'")))


def _settled_events(s: Scenario) -> Counter[str]:
    """How many times each run's on_settled hook ran (the durable app's hook posts a ``settled`` event)."""
    return Counter(e["label"] for e in s.labelled("settled", ""))


@pytest.mark.long
def test_a_twenty_second_cut_under_a_flood_loses_nothing_and_settles_each_run_once(durable_scenario,
                                                                                   fault_proxy) -> None:
    s, url = durable_scenario("postgresql", "postgresql")
    proxy = fault_proxy(url)
    proxied = proxy.url_for(url)
    # Workers reach broker and store through the proxy; the test's producer does not, and floods on.
    settings = conf(proxied, durable_lease_ttl=2, durable_relay=False)
    workers = [s.worker(app=APP, conf=settings, concurrency=2, broker_url=f"durable+{proxied}").wait_ready(60)
               for _ in range(2)]
    pids = [w.process.pid for w in workers]
    ids = [s.send_task("q", "durable.outage_steps", [f"before-{n}", 0.01]) for n in range(150)]
    wait_for(lambda: len(s.labelled("end", "before-")) >= 30, timeout=60, what="the flood to be under way")
    proxy.outage()
    cut_at = time.monotonic()
    ended_at_cut = len(s.labelled("end", "before-"))
    n = 0
    while time.monotonic() - cut_at < CUT_SECONDS:
        ids.append(s.send_task("q", "durable.outage_steps", [f"during-{n}", 0.01]))
        n += 1
        time.sleep(0.05)
    proxy.restore()
    ids += [s.send_task("q", "durable.outage_steps", [f"after-{n}", 0.01]) for n in range(50)]
    # By each run's on_settled event, not the store: a settle whose COMMIT reached the server while the cut
    # swallowed its reply is claimed by its settler once the store answers (settled_by; its re-send could
    # not be published on the cut broker), so no run's hook is lost.
    try:
        wait_for(lambda: set(_settled_events(s)) >= set(ids), timeout=120,
                 what=f"the on_settled event of each of the {len(ids)} runs", every=0.25)
    except AssertionError as err:
        unseen = sorted(set(ids) - set(_settled_events(s)))
        raise AssertionError(f"{err}: {len(unseen)} without one, e.g. {unseen[:3]} "
                             f"in states {Counter(run_state(url, run_id) for run_id in unseen)}") from None
    assert ended_at_cut < 150, "the flood was over before the cut"
    assert all(run_state(url, run_id) == "succeeded" for run_id in ids)
    ledgers = _ledgers(url)
    assert set(ledgers) == set(ids) and set(ledgers.values()) == {1}, "a transactional step committed twice"
    wait_for(lambda: s.broker_depth("q") == 0, timeout=30, what="every row acked")
    settled = _settled_events(s)
    assert {run_id: count for run_id, count in settled.items() if count > 1} == {}, "a run settled twice"
    assert set(settled) == set(ids)
    # Reconnected, not restarted: the same processes, still running.
    assert [w.process.pid for w in workers] == pids and all(w.process.poll() is None for w in workers)
    for w in workers:
        # While the database was away the consumer's connect failed and kombu retried it with its
        # backoff, as on Redis, instead of "connecting" and restarting Celery's consumer in a tight loop.
        assert "Frequent restarts detected" not in w.log()
        assert "Unrecoverable error" not in w.log()
    for w in workers:
        assert w.terminate() == 0
