"""Durable tasks on real ``celery worker -P durable`` processes: a SIGKILL after a step, sleep, dead and requeue."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery

import celery_durable
from celery_durable import runs as durable_runs
from celery_durable.store.engine import engine_for, ensure_schema
from tests.e2e.durableapp import EFFECTS_DDL
from tests.e2e.harness import Scenario, wait_for
from tests.services import broker_url
from tests.stores import fresh_store

APP = "tests.e2e.durableapp"


@pytest.fixture
def durable_scenario(tmp_path: Path) -> Iterator:
    """make(store_kind) -> (Scenario on Redis with one queue "q", store URL); cleaned up after."""
    made: list[Scenario] = []
    stores = []

    def make(kind: str) -> tuple[Scenario, str]:
        store = fresh_store(kind, tmp_path)
        url = store.__enter__()
        stores.append(store)
        ensure_schema(url)
        with engine_for(url).begin() as conn:
            conn.exec_driver_sql(EFFECTS_DDL)
        s = Scenario("redis", broker_url("redis"), ["q"])
        made.append(s)
        return s, url

    yield make
    for s in made:
        s.cleanup()
    for store in stores:
        store.__exit__(None, None, None)


def effects(url: str, run_id: str) -> dict[str, int]:
    with engine_for(url).connect() as conn:
        rows = conn.execute(sa.text("SELECT step, count(*) FROM e2e_effects WHERE run_id = :r GROUP BY step"),
                            {"r": run_id})
        return {step: int(n) for step, n in rows}


def run_state(url: str, run_id: str) -> str | None:
    with engine_for(url).connect() as conn:
        return conn.execute(sa.text("SELECT state FROM durable_runs WHERE id = :r"), {"r": run_id}).scalar()


def conf(url: str, **extra: object) -> dict:
    return {"durable_database_url": url, **extra}


@pytest.mark.parametrize("store_kind", ["postgresql", "sqlite"])
def test_a_run_killed_after_step_two_resumes_at_step_three_and_its_duplicate_is_a_no_op(
        durable_scenario, store_kind):
    s, url = durable_scenario(store_kind)
    redelivery = conf(url, durable_restore_interval=0.5, broker_transport_options={"visibility_timeout": 3})
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
    assert second.terminate() == 0


def test_a_durable_sleep_frees_the_slot_for_another_task(durable_scenario):
    s, url = durable_scenario("postgresql")
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


def _jobs_total(port: int, queue: str, outcome: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(rf'^jobs_total\{{outcome="{outcome}",queue="{re.escape(queue)}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_dead_run_is_counted_where_it_ran_handed_to_its_hook_and_requeued(durable_scenario):
    s, url = durable_scenario("postgresql")
    port = 19000 + (hash(s.key) % 1000)
    # Thread execution: the counter lives in the worker process, which serves it.
    worker = s.worker(app=APP, conf=conf(url, durable_execution="threads", durable_metrics_port=port),
                      concurrency=2).wait_ready()
    run_id = s.send_task("q", "durable.doomed", ["parcel"])
    wait_for(lambda: s.labelled("settled", run_id), timeout=30, what="the run to settle")
    settled = s.labelled("settled", run_id)
    assert [e["state"] for e in settled] == ["dead"]
    assert "carrier rejected" in settled[0]["error"]
    queue = s.by_name["q"]
    assert _jobs_total(port, queue, "dead_lettered") == 1.0
    assert _jobs_total(port, queue, "failed") == 1.0
    assert "durable.run.dead" in worker.log()

    s.observer.set(f"{s.key}:carrier-fixed", "1")
    operator = Celery("operator", broker=s.broker_url)
    celery_durable.install(operator)
    operator.conf.durable_database_url = url
    assert durable_runs.requeue(run_id, app=operator).state == "failed"
    wait_for(lambda: run_state(url, run_id) == "succeeded", timeout=30, what="the requeued run to succeed")
    assert effects(url, run_id) == {"charge": 1, "ship": 1}
    assert [e["state"] for e in s.labelled("settled", run_id)] == ["dead", "succeeded"]
    assert _jobs_total(port, queue, "dead_lettered") == 1.0
    assert worker.terminate() == 0
