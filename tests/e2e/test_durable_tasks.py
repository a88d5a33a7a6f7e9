"""Durable tasks on real ``celery worker -P durable`` processes: a SIGKILL after a step, sleep, dead and requeue."""

from __future__ import annotations

import pytest
from celery import Celery

import celery_durable
from celery_durable.tasks import runs as durable_runs
from tests.conftest import MESSAGE_BROKERS
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
from tests.e2e.harness import wait_for


def _redelivery(url: str, broker_kind: str) -> dict:
    if broker_kind == "redis":
        # Redis gives an unacked message back only after its visibility timeout,
        # found by the worker's restore pass; RabbitMQ does at once, when the
        # killed worker's connection closes.
        return conf(url, durable_restore_interval=0.5, broker_transport_options={"visibility_timeout": 3},
                    durable_lease_ttl=2)
    # The killed attempt's lease must expire before the redelivery may take the run over.
    return conf(url, durable_lease_ttl=2)


@pytest.mark.parametrize("store_kind", ["postgresql", "sqlite"])
@pytest.mark.parametrize("broker_kind", MESSAGE_BROKERS)
def test_a_run_killed_after_step_two_resumes_at_step_three_and_its_duplicate_is_a_no_op(
        durable_scenario, store_kind, broker_kind):
    s, url = durable_scenario(store_kind, broker_kind)
    redelivery = _redelivery(url, broker_kind)
    first = s.worker(app=APP, conf=redelivery, concurrency=1).wait_ready()
    run_id = s.send_task("q", "durable.three_steps", ["order"])
    wait_for(lambda: s.labelled("after-s2", "order"), timeout=30, what="step 2 to commit")
    first.kill()
    assert effects(url, run_id) == {"s1": 1, "s2": 1}
    assert run_state(url, run_id) == "running"

    second = s.worker(app=APP, conf=redelivery, concurrency=1).wait_ready()
    wait_for(lambda: run_state(url, run_id) == "succeeded", timeout=40, what="the redelivered run to succeed")
    assert effects(url, run_id) == {"s1": 1, "s2": 1, "s3": 1}

    # The same task id again (a re-sent message): acked, body not run.
    s.send_task("q", "durable.three_steps", ["order"], task_id=run_id)
    wait_for(lambda: "durable.run.duplicate" in second.log(), timeout=20, what="the duplicate to be logged")
    assert effects(url, run_id) == {"s1": 1, "s2": 1, "s3": 1}
    assert len(s.labelled("end", "order")) == 1
    # on_settled once: not for the killed attempt, not for the duplicate.
    assert [e["state"] for e in s.labelled("settled", run_id)] == ["succeeded"]
    assert second.terminate() == 0


@pytest.mark.parametrize(("store_kind", "broker_kind"), [("postgresql", "redis"), ("sqlite", "rabbitmq")])
def test_a_durable_sleep_frees_the_slot_for_another_task(durable_scenario, store_kind, broker_kind):
    s, url = durable_scenario(store_kind, broker_kind)
    worker = s.worker(app=APP, conf=conf(url, durable_max_in_flight=1), concurrency=1).wait_ready()
    sleeper_id = s.send_task("q", "durable.sleeper", ["sleeper", 2.0])
    # The quick task is sent only once the sleeper's re-sent message is back in
    # this worker, waiting for its wake time: the sleep must not hold the one slot.
    worker.wait_durable(lambda st: st["scheduled"] == 1 and st["in_flight"] == 0, timeout=20,
                        what="the sleeping run to wait in the worker without a slot")
    s.send_task("q", "durable.quick", ["quick"])
    wait_for(lambda: s.labelled("woke", "sleeper"), timeout=30, what="the sleeper to wake")
    execs = s.labelled("exec", "sleeper")
    quick_start, quick_end = s.labelled("start", "quick")[0], s.labelled("end", "quick")[0]
    woke = s.labelled("woke", "sleeper")[0]
    # With one slot, the quick task ran between the sleeper's two executions.
    assert len(execs) == 2
    assert execs[0]["t"] < quick_start["t"] <= quick_end["t"] < execs[1]["t"] <= woke["t"]
    assert execs[1]["t"] - execs[0]["t"] >= 2.0, "the sleeper woke early"
    assert effects(url, sleeper_id) == {"before": 1, "after": 1}
    assert run_state(url, sleeper_id) == "succeeded"
    assert worker.terminate() == 0


def test_a_durable_sleep_inside_a_bodys_except_exception_still_sleeps_and_resumes(durable_scenario):
    s, url = durable_scenario("postgresql", "redis")
    worker = s.worker(app=APP, conf=conf(url), concurrency=1).wait_ready()
    run_id = s.send_task("q", "durable.guarded_sleeper", ["guarded", 1.5])
    wait_for(lambda: s.labelled("woke", "guarded"), timeout=30, what="the guarded sleeper to wake")
    execs = s.labelled("exec", "guarded")
    # The hand-off ended the first execution; the wake-up ran the body again past the sleep.
    assert s.labelled("swallowed", "guarded") == []
    assert len(execs) == 2
    assert s.labelled("woke", "guarded")[0]["t"] - execs[0]["t"] >= 1.5, "the guarded sleeper woke early"
    assert effects(url, run_id) == {"after": 1}
    assert run_state(url, run_id) == "succeeded"
    assert worker.terminate() == 0


@pytest.mark.parametrize("execution", ["prefork", "threads"])
def test_a_dead_run_is_counted_by_the_worker_handed_to_its_hook_and_requeued(durable_scenario, execution):
    s, url = durable_scenario("postgresql")
    port = free_port()
    # Prefork: a fresh child per run, so the endpoint (served by the parent)
    # must sum children that ran and were replaced.
    extra = ["--max-tasks-per-child", "1"] if execution == "prefork" else []
    worker = s.worker(app=APP, conf=conf(url, durable_execution=execution, durable_metrics_port=port),
                      concurrency=2, extra_args=extra).wait_ready()
    queue = s.by_name["q"]
    run_id = s.send_task("q", "durable.doomed", ["parcel"])
    wait_for(lambda: s.labelled("settled", run_id), timeout=30, what="the run to settle")
    settled = s.labelled("settled", run_id)
    assert [e["state"] for e in settled] == ["dead"]
    assert "carrier rejected" in settled[0]["error"]
    wait_for(lambda: jobs_total(port, queue, "dead_lettered") == 1.0, timeout=10,
             what="jobs_total{outcome=dead_lettered} to reach 1 on the worker's endpoint")
    assert jobs_total(port, queue, "failed") == 1.0
    assert "durable.run.dead" in worker.log()

    quick_id = s.send_task("q", "durable.quick", ["quick"])
    wait_for(lambda: jobs_total(port, queue, "succeeded") == 1.0, timeout=20,
             what="jobs_total{outcome=succeeded} to reach 1")
    s.send_task("q", "durable.quick", ["quick"], task_id=quick_id)
    wait_for(lambda: jobs_total(port, queue, "duplicate") == 1.0, timeout=20,
             what="jobs_total{outcome=duplicate} to reach 1")
    assert len(s.labelled("start", "quick")) == 1

    s.observer.set(f"{s.key}:carrier-fixed", "1")
    operator = Celery("operator", broker=s.broker_url)
    celery_durable.install(operator)
    operator.conf.durable_database_url = url
    assert durable_runs.requeue(run_id, app=operator).state == "failed"
    wait_for(lambda: run_state(url, run_id) == "succeeded", timeout=30, what="the requeued run to succeed")
    assert effects(url, run_id) == {"charge": 1, "ship": 1}
    # The hook runs after the row is written: wait for its second call.
    wait_for(lambda: len(s.labelled("settled", run_id)) >= 2, timeout=10, what="on_settled after the requeue")
    assert [e["state"] for e in s.labelled("settled", run_id)] == ["dead", "succeeded"]
    wait_for(lambda: jobs_total(port, queue, "succeeded") == 2.0, timeout=10,
             what="jobs_total{outcome=succeeded} to reach 2")
    assert jobs_total(port, queue, "dead_lettered") == 1.0
    assert jobs_total(port, queue, "duplicate") == 1.0
    assert worker.terminate() == 0


@pytest.mark.parametrize("kind, problem", [
    ("nul", "contains a NUL character"),
    ("surrogate", "is not encodable as UTF-8: a lone surrogate"),
    ("too-long", "is 201 characters; at most 200"),
])
def test_a_step_name_the_store_cannot_hold_buries_the_run_at_once_without_calling_fn(
        durable_scenario, kind, problem):
    s, url = durable_scenario("postgresql")
    worker = s.worker(app=APP, conf=conf(url), concurrency=1).wait_ready()
    run_id = s.send_task("q", "durable.bad_step_name", [kind])
    wait_for(lambda: s.labelled("settled", run_id), timeout=30, what="the run to settle")
    settled = s.labelled("settled", run_id)
    assert [e["state"] for e in settled] == ["dead"]
    assert "StepNameInvalid" in settled[0]["error"] and problem in settled[0]["error"], settled[0]["error"]
    # Refused before fn: no effect row, and buried on its first attempt (no retry burned).
    assert effects(url, run_id) == {}
    assert len(s.labelled("start", kind)) == 1
    row = run_row(url, run_id)
    assert (row.state, row.attempts) == ("dead", 1)
    assert worker.terminate() == 0
