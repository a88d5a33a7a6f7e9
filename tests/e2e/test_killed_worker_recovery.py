"""A killed worker's held runs run again within 2 × ``durable_lease_ttl``, on every broker, with the broker's
default settings (Redis: kombu's 1-hour ``visibility_timeout``): liveness decides, not a broker timer.

A ``-P durable`` worker holds a plain ``acks_late`` task and a 3-step durable task, both mid-run, and a durable
sleep's wake-up, when it is SIGKILLed; a second worker, already running a long durable run of its own, takes
them over. The live run is never restored or run twice.
"""

from __future__ import annotations

import subprocess
import time

import pytest
import redis

from celery_durable.store.engine import engine_for, ensure_schema
from tests.conftest import MESSAGE_BROKERS
from tests.e2e.durable_support import APP, conf, durable_scenario, effects, run_state  # noqa: F401 - fixture
from tests.e2e.durableapp import EFFECTS_DDL
from tests.e2e.harness import Scenario, WorkerProcess, wait_for
from tests.services import redis_problem, require

TTL = 3.0


@pytest.mark.parametrize("store_kind, broker_kind", [("postgresql", "redis"), ("postgresql", "rabbitmq"),
                                                     ("postgresql", "postgresql"), ("sqlite", "sqlite")])
def test_a_killed_workers_runs_finish_within_two_lease_ttls_and_a_live_run_is_left_alone(
        durable_scenario, store_kind, broker_kind):
    s, url = durable_scenario(store_kind, broker_kind)
    # On the broker that claims rows a countdown rides the row's visible_at: no worker holds it early.
    rows_broker = broker_kind == store_kind
    settings = conf(url, durable_lease_ttl=TTL)
    victim = s.worker(app=APP, conf=settings, concurrency=2).wait_ready()
    # A durable sleep whose wake-up (an ETA message) the victim holds when it dies (a row no one holds yet,
    # on the rows broker).
    sleeper_id = s.send_task("q", "durable.sleeper", ["sleeper", 2 * TTL])
    if rows_broker:
        wait_for(lambda: run_state(url, sleeper_id) == "sleeping", timeout=20, what="the sleeper to sleep")
    else:
        victim.wait_durable(lambda st: st["scheduled"] == 1, timeout=20, what="the victim to hold the wake-up")
    plain_id = s.send_task("q", "durable.plain_held", ["plain"])
    durable_id = s.send_task("q", "durable.three_steps", ["durable"])
    wait_for(lambda: s.labelled("exec", "plain") and s.labelled("after-s2", "durable"), timeout=20,
             what="both runs to be mid-run on the victim")
    # The survivor starts now (the victim is full, so it takes nothing of its) and runs 3 × TTL of its own.
    survivor = s.worker(app=APP, conf=settings, concurrency=3).wait_ready()
    live_id = s.send_task("q", "durable.long_steps", ["live", 3, TTL])
    wait_for(lambda: s.labelled("exec", "live"), timeout=20, what="the survivor to start its long run")
    victim_pids = {s.labelled("exec", "plain")[0]["pid"], s.labelled("after-s2", "durable")[0]["pid"]}
    assert s.labelled("exec", "live")[0]["pid"] not in victim_pids
    victim.wait_durable(lambda st: st["in_flight"] == 2 and st["scheduled"] == (0 if rows_broker else 1),
                        timeout=5, what="the victim to hold exactly its two runs and the wake-up")

    killed_at = time.time()
    victim.kill()
    wait_for(lambda: s.labelled("end", "plain") and run_state(url, durable_id) == "succeeded", timeout=6 * TTL,
             what="the killed worker's two runs to finish elsewhere")
    finished = max(s.labelled("end", "plain")[0]["t"], s.labelled("end", "durable")[0]["t"])
    assert finished - killed_at <= 2 * TTL, f"took {finished - killed_at:.2f}s, more than 2 x TTL ({2 * TTL}s)"
    # The durable run resumed from its checkpoint: each step's effect once.
    assert effects(url, durable_id) == {"s1": 1, "s2": 1, "s3": 1}
    assert [e["id"] for e in s.labelled("end", "plain")] == [plain_id]

    wait_for(lambda: run_state(url, sleeper_id) == "succeeded", timeout=6 * TTL, what="the sleeper to wake")
    assert len(s.labelled("woke", "sleeper")) == 1 and effects(url, sleeper_id) == {"before": 1, "after": 1}

    wait_for(lambda: run_state(url, live_id) == "succeeded", timeout=6 * TTL, what="the live run to finish")
    assert len(s.labelled("exec", "live")) == 1, "the live run was restored and run again"
    assert effects(url, live_id) == {"s0": 1, "s1": 1, "s2": 1}
    survivor.wait_durable(lambda st: st["in_flight"] == 0, timeout=20, what="the survivor to hold nothing")
    assert s.broker_depth("q") == 0
    assert survivor.terminate() == 0


@pytest.mark.parametrize("broker_kind", MESSAGE_BROKERS)
def test_a_run_whose_message_was_deleted_resumes_from_its_checkpoint_within_three_lease_ttls(
        durable_scenario, broker_kind):
    """The worker dies and its message is gone from the broker (purged, deleted by hand, a broker restarted
    without persistence): the fleet sends the run again, and it resumes after its last checkpoint."""
    s, url = durable_scenario("postgresql", broker_kind)
    ttl = 4.0
    # Unacked records of this test's own (Redis): deleting them deletes only this test's message.
    own = {"unacked_key": f"{s.key}.unacked", "unacked_index_key": f"{s.key}.unacked_index",
           "unacked_mutex_key": f"{s.key}.unacked_mutex"}
    settings = conf(url, durable_lease_ttl=ttl, broker_transport_options=own)
    victim = s.worker(app=APP, conf=settings, concurrency=1).wait_ready()
    run_id = s.send_task("q", "durable.three_steps", ["gone"])
    wait_for(lambda: s.labelled("after-s2", "gone"), timeout=20, what="the run to be past its second step")
    killed_at = time.time()
    victim.kill()
    if broker_kind == "redis":
        client = redis.Redis.from_url(s.broker_url)
        assert client.hlen(own["unacked_key"]) == 1, "the killed worker's message was not held unacked"
        # Gone: the message, its unacked record and the dead worker's record of holding it.
        client.delete(*own.values(), *client.scan_iter(match=f"{own['unacked_key']}.durable_*"))
    else:
        wait_for(lambda: s.broker_depth("q") == 1, timeout=10, what="RabbitMQ to requeue the killed one's message")
        with s.producer.connection_for_write() as conn:
            conn.default_channel.queue_purge(s.by_name["q"])
    assert s.broker_depth("q") == 0
    survivor = s.worker(app=APP, conf=settings, concurrency=1).wait_ready()
    wait_for(lambda: run_state(url, run_id) == "succeeded", timeout=6 * ttl, what="the stranded run to finish")
    finished = s.labelled("end", "gone")[0]["t"]
    assert finished - killed_at <= 3 * ttl, f"took {finished - killed_at:.2f}s, more than 3 x TTL ({3 * ttl}s)"
    assert effects(url, run_id) == {"s1": 1, "s2": 1, "s3": 1}
    wait_for(lambda: "durable.run.recovered" in survivor.log(), timeout=5, what="the recovery to be logged")
    assert survivor.terminate() == 0
    if broker_kind == "redis":
        client.delete(*client.scan_iter(match=f"{own['unacked_key']}.durable_*"))


def test_on_the_embedded_broker_a_killed_workers_durable_run_resumes_by_the_sweep(tmp_path):
    """kombu's SQLAlchemy transport keeps no unacked record: a message taken by a worker that dies is gone
    for good. A durable run's row still says it was running: the fleet's sweep sends it again."""
    require("Redis (observation)", redis_problem())
    ttl = 3.0
    store = f"sqlite:///{tmp_path}/store.sqlite"
    ensure_schema(store)
    with engine_for(store).begin() as conn:
        conn.exec_driver_sql(EFFECTS_DDL)
    s = Scenario("sqla", f"sqla+sqlite:///{tmp_path}/broker.sqlite", ["q"])
    settings = conf(store, durable_lease_ttl=ttl)
    try:
        victim = s.worker(app=APP, conf=settings, concurrency=1).wait_ready(60)
        survivor = s.worker(app=APP, conf=settings, concurrency=1).wait_ready(60)
        run_id = s.send_task("q", "durable.three_steps", ["embedded"])
        wait_for(lambda: s.labelled("after-s2", "embedded"), timeout=30, what="the run to be past its second step")
        ran_on = s.labelled("after-s2", "embedded")[0]["pid"]
        holder, other = (victim, survivor) if ran_on in _pids(victim) else (survivor, victim)
        killed_at = time.time()
        holder.kill()
        wait_for(lambda: run_state(store, run_id) == "succeeded", timeout=8 * ttl, what="the run to be recovered")
        finished = s.labelled("end", "embedded")[0]["t"]
        assert finished - killed_at <= 3 * ttl, f"took {finished - killed_at:.2f}s, more than 3 x TTL ({3 * ttl}s)"
        assert effects(store, run_id) == {"s1": 1, "s2": 1, "s3": 1}
        assert "durable.run.recovered" in other.log()
        assert other.terminate() == 0
    finally:
        for worker in s._workers:
            worker.kill()
        s.observer.delete(s.key)


def _pids(worker: WorkerProcess) -> set[int]:
    found = subprocess.run(["pgrep", "-P", str(worker.process.pid)], capture_output=True, text=True, check=False)
    return {worker.process.pid, *(int(p) for p in found.stdout.split())}
