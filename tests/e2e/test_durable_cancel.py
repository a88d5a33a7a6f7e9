"""Revoking a durable task on a real ``celery worker -P durable``: its run is cancelled once, for good."""

from __future__ import annotations

import pytest

from tests.e2e.durable_support import (  # noqa: F401 - durable_scenario is a fixture
    APP,
    conf,
    durable_scenario,
    effects,
    free_port,
    jobs_total,
    run_row,
    run_state,
)
from tests.e2e.harness import Scenario, WorkerProcess, wait_for


def _revoke(s: Scenario, worker: WorkerProcess, run_id: str, **options: object) -> None:
    # reply=True: the worker has the id in its revoked set before the test goes on.
    replies = s.producer.control.revoke(run_id, destination=[worker.hostname], reply=True, timeout=10,
                                        **options)
    assert replies, f"{worker.hostname} did not acknowledge the revoke"


def _settled_states(s: Scenario, run_id: str) -> list[str]:
    return [e["state"] for e in s.labelled("settled", run_id)]


def _redelivery_on_a_fresh_worker_is_a_duplicate(s: Scenario, url: str, run_id: str, task: str,
                                                 args: list[str]) -> None:
    # A fresh worker has an empty revoked set (as after a restart): only the
    # store keeps the cancelled run from running again.
    port = free_port()
    fresh = s.worker(app=APP, conf=conf(url, durable_metrics_port=port), concurrency=1).wait_ready()
    s.send_task("q", task, args, task_id=run_id)
    wait_for(lambda: jobs_total(port, s.by_name["q"], "duplicate") == 1.0, timeout=20,
             what="the redelivery to be counted as a duplicate")
    assert run_state(url, run_id) == "cancelled"
    assert jobs_total(port, s.by_name["q"], "cancelled") == 0.0
    assert _settled_states(s, run_id) == ["cancelled"], "the hook ran again for a duplicate"
    assert fresh.terminate() == 0


@pytest.mark.parametrize(("store_kind", "broker_kind", "execution"),
                         [("sqlite", "rabbitmq", "prefork"), ("postgresql", "redis", "threads")])
def test_revoking_a_queued_run_cancels_it_once_and_a_redelivery_is_a_no_op(
        durable_scenario, store_kind, broker_kind, execution):
    s, url = durable_scenario(store_kind, broker_kind)
    port = free_port()
    worker = s.worker(app=APP, conf=conf(url, durable_execution=execution, durable_max_in_flight=1,
                                         durable_metrics_port=port), concurrency=1).wait_ready()
    queue = s.by_name["q"]
    # The blocker holds the one slot, so the next run waits in the broker (-P durable does not prefetch).
    blocker = s.send_task("q", "durable.three_steps", ["blocker"])
    wait_for(lambda: s.labelled("after-s2", "blocker"), timeout=30, what="the blocker to hold the slot")
    queued = s.send_task("q", "durable.quick", ["queued"])
    _revoke(s, worker, queued)
    s.open_gate("blocker")

    wait_for(lambda: run_state(url, queued) == "cancelled", timeout=30, what="the revoked run to be cancelled")
    assert run_state(url, blocker) == "succeeded"
    assert s.labelled("start", "queued") == [], "the revoked run's body ran"
    row = run_row(url, queued)
    assert (row.attempts, row.last_error, row.queue) == (0, "revoked", queue)
    assert row.finished_at is not None
    # The hook runs after the row is written: wait for it, then check it ran once.
    settled = wait_for(lambda: s.labelled("settled", queued), timeout=10, what="on_settled to be called")
    assert [e["state"] for e in settled] == ["cancelled"]
    assert settled[0]["pid"] == worker.process.pid, "on_settled ran outside the worker process"
    wait_for(lambda: jobs_total(port, queue, "cancelled") == 1.0, timeout=10,
             what="jobs_total{outcome=cancelled} to reach 1")
    assert worker.terminate() == 0

    _redelivery_on_a_fresh_worker_is_a_duplicate(s, url, queued, "durable.quick", ["queued"])
    assert s.labelled("start", "queued") == []


@pytest.mark.parametrize(("store_kind", "broker_kind"), [("postgresql", "redis"), ("sqlite", "rabbitmq")])
def test_terminating_a_running_run_cancels_it_between_steps_and_frees_its_slot(
        durable_scenario, store_kind, broker_kind):
    s, url = durable_scenario(store_kind, broker_kind)
    port = free_port()
    worker = s.worker(app=APP, conf=conf(url, durable_metrics_port=port), concurrency=1).wait_ready()
    queue = s.by_name["q"]
    victim = s.send_task("q", "durable.three_steps", ["victim"])
    wait_for(lambda: s.labelled("after-s2", "victim"), timeout=30, what="step 2 to commit")
    _revoke(s, worker, victim, terminate=True)

    wait_for(lambda: run_state(url, victim) == "cancelled", timeout=30, what="the terminated run to be cancelled")
    assert "terminated" in run_row(url, victim).last_error
    wait_for(lambda: jobs_total(port, queue, "cancelled") == 1.0, timeout=10,
             what="jobs_total{outcome=cancelled} to reach 1")
    wait_for(lambda: s.labelled("settled", victim), timeout=10, what="on_settled to be called")
    # The pool's one process was killed and replaced; the slot came back.
    after = s.send_task("q", "durable.quick", ["after"])
    wait_for(lambda: run_state(url, after) == "succeeded", timeout=30, what="the next run to succeed")
    assert effects(url, victim) == {"s1": 1, "s2": 1}
    assert s.labelled("end", "victim") == []
    assert _settled_states(s, victim) == ["cancelled"]
    assert jobs_total(port, queue, "failed") == 0.0
    assert worker.terminate() == 0

    _redelivery_on_a_fresh_worker_is_a_duplicate(s, url, victim, "durable.three_steps", ["victim"])
    assert effects(url, victim) == {"s1": 1, "s2": 1}
