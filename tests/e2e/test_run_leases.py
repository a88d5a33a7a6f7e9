"""Run leases on real ``-P durable`` workers: a live run is never run twice, a dead holder's run is taken over,
a sleeper is not multiplied, and a run that keeps killing its worker is buried."""

from __future__ import annotations

from typing import Any

import pytest

from celery_durable.tasks import runs as durable_runs
from tests.conftest import MESSAGE_BROKERS
from tests.e2e.durable_support import (  # noqa: F401 - durable_scenario is a fixture
    APP,
    conf,
    durable_scenario,
    effects,
    operator_app,
    run_row,
    run_state,
)
from tests.e2e.harness import wait_for


def redis_short_visibility(url: str, **extra: Any) -> dict[str, Any]:
    """A visibility timeout far shorter than the runs: any restore of live work would show."""
    return conf(url, broker_transport_options={"visibility_timeout": 2}, durable_restore_interval=0.3,
                durable_lease_ttl=2, **extra)


@pytest.mark.parametrize("store_kind", ["postgresql", "sqlite"])
def test_a_run_longer_than_the_visibility_timeout_runs_once_on_redis(durable_scenario, store_kind):
    s, url = durable_scenario(store_kind, "redis")
    workers = [s.worker(app=APP, conf=redis_short_visibility(url), concurrency=2).wait_ready()
               for _ in range(2)]
    # 5 steps x 1.2 s: three visibility timeouts long.
    run_id = s.send_task("q", "durable.long_steps", ["long", 5, 1.2])
    wait_for(lambda: run_state(url, run_id) == "succeeded", timeout=60, what="the long run to succeed")
    assert effects(url, run_id) == {f"s{n}": 1 for n in range(5)}
    assert len(s.labelled("exec", "long")) == 1, "the body was started twice"
    assert run_row(url, run_id).attempts == 1
    for worker in workers:
        assert worker.process.poll() is None
        assert "durable.run.deferred" not in worker.log(), "a live run's message was restored"
        assert worker.terminate() == 0


@pytest.mark.parametrize(("store_kind", "broker_kind"), [("postgresql", "redis"), ("sqlite", "rabbitmq")])
def test_a_copy_of_a_live_run_is_deferred_never_run_beside_it(durable_scenario, store_kind, broker_kind):
    s, url = durable_scenario(store_kind, broker_kind)
    worker = s.worker(app=APP, conf=conf(url, durable_lease_ttl=2), concurrency=2).wait_ready()
    run_id = s.send_task("q", "durable.long_steps", ["live", 4, 1.0])
    wait_for(lambda: s.labelled("exec", "live"), timeout=20, what="the run to start")
    # A second message with the same id while the first runs (a restored message, a republished
    # outbox row, a connection lost after the run started: all look like this).
    s.send_task("q", "durable.long_steps", ["live", 4, 1.0], task_id=run_id)
    wait_for(lambda: "durable.run.deferred" in worker.log(), timeout=20, what="the copy to be deferred")
    wait_for(lambda: run_state(url, run_id) == "succeeded", timeout=60, what="the run to succeed")
    # The deferred copy comes back after the run settled: a duplicate, acked without running.
    wait_for(lambda: "durable.run.duplicate" in worker.log(), timeout=30, what="the copy to be dropped")
    assert effects(url, run_id) == {f"s{n}": 1 for n in range(4)}
    assert len(s.labelled("exec", "live")) == 1
    assert [e["state"] for e in s.labelled("settled", run_id)] == ["succeeded"]
    worker.wait_durable(lambda st: st["in_flight"] == 0 and st["scheduled"] == 0, timeout=20,
                        what="nothing left held")
    assert s.broker_depth("q") == 0
    assert worker.terminate() == 0


@pytest.mark.parametrize("broker_kind", MESSAGE_BROKERS)
def test_a_deferred_copy_takes_over_when_the_live_holder_dies(durable_scenario, broker_kind):
    s, url = durable_scenario("postgresql", broker_kind)
    settings = conf(url, durable_lease_ttl=2, durable_restore_interval=0.3,
                    broker_transport_options={"visibility_timeout": 600})
    # The copy's worker consumes a queue of its own, and both start before the run does: started
    # during the run's 6 s, a worker slow to boot under load (>5 s) met the run already finished.
    s.by_name["copy"] = f"{s.by_name['q']}-copy"
    s.queues.append(s.by_name["copy"])
    holder = s.worker(app=APP, conf=settings, concurrency=1).wait_ready()
    other = s.worker(app=APP, conf=settings, concurrency=1, queues=["copy"]).wait_ready()
    run_id = s.send_task("q", "durable.long_steps", ["orphan", 6, 1.0])
    wait_for(lambda: effects(url, run_id).get("s0"), timeout=20, what="the first step to commit")
    s.send_task("copy", "durable.long_steps", ["orphan", 6, 1.0], task_id=run_id)
    wait_for(lambda: "durable.run.deferred" in other.log(), timeout=20, what="the copy to be deferred")
    # The holder's own message now waits in a queue no worker consumes (RabbitMQ) or out a 600 s
    # visibility timeout (Redis): only the deferred copy can finish the run.
    holder.kill()
    wait_for(lambda: run_state(url, run_id) == "succeeded", timeout=60, what="the copy to finish the run")
    done = effects(url, run_id)
    assert set(done) == {f"s{n}" for n in range(6)}
    # Only a step the holder was inside when it died may have run twice.
    assert sum(done.values()) <= 7, done
    row = run_row(url, run_id)
    assert row.lost_attempts == 1
    assert other.process.poll() is None
    assert other.terminate() == 0


@pytest.mark.parametrize(("store_kind", "broker_kind"), [("postgresql", "redis"), ("sqlite", "redis"),
                                                         ("postgresql", "rabbitmq")])
def test_a_sleep_longer_than_the_visibility_timeout_wakes_once(durable_scenario, store_kind, broker_kind):
    s, url = durable_scenario(store_kind, broker_kind)
    worker = s.worker(app=APP, conf=redis_short_visibility(url, durable_max_scheduled=8),
                      concurrency=2).wait_ready()
    sleepers = [s.send_task("q", "durable.sleeper", [f"sleeper-{n}", 6.0]) for n in range(8)]
    worker.wait_durable(lambda st: st["scheduled"] == 8, timeout=30, what="every sleeper to wait in the worker")
    # While they sleep (three visibility timeouts), quick runs go straight through.
    quick = [s.send_task("q", "durable.quick", [f"quick-{n}"]) for n in range(5)]
    wait_for(lambda: all(run_state(url, q) == "succeeded" for q in quick), timeout=10,
             what="the quick runs to run while the sleepers wait")
    wait_for(lambda: all(run_state(url, r) == "succeeded" for r in sleepers), timeout=60,
             what="every sleeper to wake and finish")
    for n, run_id in enumerate(sleepers):
        assert len(s.labelled("woke", f"sleeper-{n}")) == 1, f"sleeper-{n} woke more than once"
        assert effects(url, run_id) == {"before": 1, "after": 1}
    assert "durable.run.duplicate" not in worker.log(), "a sleeping run's message was delivered twice"
    worker.wait_durable(lambda st: st["scheduled"] == 0 and st["in_flight"] == 0, timeout=20,
                        what="nothing left held")
    assert worker.terminate() == 0


@pytest.mark.parametrize("broker_kind", MESSAGE_BROKERS)
def test_a_run_that_kills_its_worker_every_time_is_buried_after_its_retries(durable_scenario, broker_kind):
    s, url = durable_scenario("postgresql", broker_kind)
    worker = s.worker(app=APP, conf=conf(url, durable_lease_ttl=1, durable_restore_interval=0.3,
                                         broker_transport_options={"visibility_timeout": 3}),
                      concurrency=1).wait_ready()
    run_id = s.send_task("q", "durable.self_killer", ["crash"])
    wait_for(lambda: run_state(url, run_id) == "dead", timeout=60, what="the crash-looping run to be buried")
    # max_retries=2: started 3 times, never a 4th.
    assert len(s.labelled("exec", "crash")) == 3
    row = run_row(url, run_id)
    assert (row.attempts, row.lost_attempts) == (4, 3)
    assert "RunExhausted" in row.last_error
    wait_for(lambda: "durable.run.exhausted" in worker.log(), timeout=10, what="the burial to be logged")
    # The hook runs after the row is written: wait for its call.
    wait_for(lambda: s.labelled("settled", run_id), timeout=10, what="on_settled for the buried run")
    assert [e["state"] for e in s.labelled("settled", run_id)] == ["dead"]
    wait_for(lambda: s.broker_depth("q") == 0, timeout=10, what="the message to be acked")
    assert worker.process.poll() is None

    # An operator fixes the cause and requeues it: a fresh budget, and it runs to the end.
    s.observer.set(f"{s.key}:spare:crash", "1")
    durable_runs.requeue(run_id, app=operator_app(s, url))
    wait_for(lambda: run_state(url, run_id) == "succeeded", timeout=30, what="the requeued run to succeed")
    assert len(s.labelled("end", "crash")) == 1
    assert worker.terminate() == 0


@pytest.mark.parametrize("broker_kind", MESSAGE_BROKERS)
def test_a_run_whose_worker_lost_its_broker_connection_runs_once(durable_scenario, fault_proxy, broker_kind):
    """RabbitMQ gives a message back the moment the connection that holds it closes, while the run goes on
    in the pool: the copy must wait for the live attempt, not run beside it. On Redis the worker must
    go on renewing what it holds after it reconnects."""
    s, url = durable_scenario("postgresql", broker_kind)
    proxy = fault_proxy(s.broker_url)
    settings = conf(url, durable_lease_ttl=2, durable_restore_interval=0.3,
                    broker_transport_options={"visibility_timeout": 2})
    worker = s.worker(app=APP, conf=settings, concurrency=2, broker_url=proxy.url_for(s.broker_url)).wait_ready()
    run_id = s.send_task("q", "durable.long_steps", ["cut", 5, 1.0])
    wait_for(lambda: effects(url, run_id).get("s0"), timeout=20, what="the first step to commit")
    proxy.drop_connections()
    wait_for(lambda: run_state(url, run_id) == "succeeded", timeout=60, what="the run to succeed")
    # Give a redelivered copy time to come back and be judged (it is deferred past the run's end).
    def nothing_waiting() -> bool:
        stats = worker.stats()  # None while its remote control reconnects after the cut
        return s.broker_depth("q") == 0 and stats is not None and stats["durable"]["scheduled"] == 0

    wait_for(nothing_waiting, timeout=30, what="no copy left waiting")
    assert effects(url, run_id) == {f"s{n}": 1 for n in range(5)}
    assert len(s.labelled("exec", "cut")) == 1, "the body started twice"
    assert worker.process.poll() is None
    assert worker.terminate() == 0
