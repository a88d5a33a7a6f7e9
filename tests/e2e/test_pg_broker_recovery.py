"""Held work on the PostgreSQL broker comes back by lease, with real ``-P durable`` workers: a SIGKILLed worker's
four runs run again once, after the lease TTL and never before; a SIGSTOPped holder resumed after its lease
lapsed commits no step of the run another worker took, spends no retry and leaves the survivor's result."""

from __future__ import annotations

import signal
import time

import sqlalchemy as sa
from celery import Celery
from celery.result import AsyncResult

from celery_durable.store.engine import engine_for
from tests.e2e.durable_support import APP, conf, durable_scenario, effects, run_state  # noqa: F401 - fixture
from tests.e2e.harness import wait_for
from tests.services import REDIS_URL

TTL = 3.0


def test_a_sigkilled_worker_holding_four_runs_has_each_run_again_once_after_the_ttl(durable_scenario) -> None:
    s, url = durable_scenario("postgresql", "postgresql")
    settings = conf(url, durable_lease_ttl=TTL)
    victim = s.worker(app=APP, conf=settings, concurrency=4).wait_ready()
    ids = [s.send_task("q", "durable.three_steps", [f"r{i}"]) for i in range(4)]
    # Each run committed s1 and s2 and waits (first attempt) for a gate nobody opens.
    wait_for(lambda: len(s.labelled("after-s2", "r")) == 4, timeout=30, what="the victim to hold all four runs")
    survivor = s.worker(app=APP, conf=settings, concurrency=4).wait_ready()
    killed_at = time.time()
    victim.kill()
    # The victim renewed its leases every TTL/3: the earliest a lease can lapse is 2/3 TTL after the kill.
    wait_for(lambda: len(s.labelled("end", "r")) == 4, timeout=6 * TTL, what="the four runs to end on the survivor")
    ends = s.labelled("end", "r")
    assert sorted(e["id"] for e in ends) == sorted(ids), "a run ended twice or not at all"
    first_end = min(e["t"] for e in ends) - killed_at
    last_end = max(e["t"] for e in ends) - killed_at
    assert first_end >= TTL * 2 / 3 - 0.1, f"a run came back {first_end:.2f}s after the kill, before its lease lapsed"
    assert last_end <= 2 * TTL, f"took {last_end:.2f}s, more than 2 x TTL"
    for run_id in ids:
        # The body's "end" event comes just before its attempt settles the run: wait for the settle.
        wait_for(lambda run_id=run_id: run_state(url, run_id) == "succeeded", timeout=10,
                 what=f"run {run_id} to be settled succeeded")
        assert effects(url, run_id) == {"s1": 1, "s2": 1, "s3": 1}
    wait_for(lambda: s.broker_depth("q") == 0, timeout=10, what="every row acked")
    assert survivor.terminate() == 0


def test_a_sigstopped_holder_resumed_after_its_lease_lapsed_commits_no_step_of_the_run_taken_over(
        durable_scenario) -> None:
    s, url = durable_scenario("postgresql", "postgresql")
    # Threads: the run executes in the worker's own process, so SIGSTOP freezes the run with its heartbeats.
    # A result backend: the stale holder must not write RETRY or FAILURE over the survivor's SUCCESS.
    settings = conf(url, durable_lease_ttl=TTL, durable_execution="threads", result_backend=REDIS_URL)
    stale = s.worker(app=APP, conf=settings, concurrency=1).wait_ready()
    run_id = s.send_task("q", "durable.outage_steps", ["x", 1.5])
    wait_for(lambda: s.labelled("effect", "x"), timeout=30, what="the first worker to be inside the first step")
    stale.process.send_signal(signal.SIGSTOP)
    try:
        survivor = s.worker(app=APP, conf=settings, concurrency=1).wait_ready()
        wait_for(lambda: run_state(url, run_id) == "succeeded", timeout=6 * TTL,
                 what="the survivor to take the run over once the stopped holder's leases lapsed")
        assert len(s.labelled("exec", "x")) == 2
    finally:
        stale.process.send_signal(signal.SIGCONT)
    # Resumed: its first step returns and its checkpoint meets the lease fence (before the fence: a duplicate
    # key, an ordinary error, so Celery's autoretry sent a retry and the settle found the run taken over).
    wait_for(lambda: any(event in stale.log() for event in ("durable.run.lease_lost", "durable.run.settled_before")),
             timeout=20, what="the resumed holder to find its run taken over")
    time.sleep(TTL)  # room for a wrong commit (its transactional step is next) or a retry to land before counting
    with engine_for(url).connect() as conn:
        ledger = conn.execute(sa.text("SELECT count(*) FROM e2e_effects WHERE run_id = :r AND step = 'ledger'"),
                              {"r": run_id}).scalar_one()
    assert ledger == 1, f"the transactional step committed {ledger} times"
    # No retry spent: no retry message, so no third delivery (it would find the run settled: a duplicate).
    logs = stale.log() + survivor.log()
    assert f"[{run_id}] retry:" not in logs, "the stale holder's lost lease spent a retry"
    assert "durable.run.duplicate" not in logs, "a retry message of the stale holder was delivered"
    assert [e["retries"] for e in s.labelled("exec", "x")] == [0, 0]
    assert "durable.run.lease_lost" in stale.log()
    assert AsyncResult(run_id, app=Celery("reader", backend=REDIS_URL)).state == "SUCCESS"
    assert run_state(url, run_id) == "succeeded"
    assert len(s.labelled("end", "x")) == 1
    wait_for(lambda: s.broker_depth("q") == 0, timeout=10, what="the row acked by the survivor only")
    assert survivor.terminate() == 0
