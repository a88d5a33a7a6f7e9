"""The queue gauges against real brokers and a real worker: depth, oldest ready age, dead runs, per queue."""

from __future__ import annotations

import re
import urllib.request

import pytest

import celery_durable
from tests.e2e.durable_support import APP, conf, durable_scenario, effects, free_port, run_state  # noqa: F401
from tests.e2e.harness import wait_for


def queue_gauges(port: int, queue: str) -> dict[str, float]:
    """The ``job_queue_*`` samples of ``queue`` the worker's endpoint serves now."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.findall(rf'^(job_queue_\w+)\{{queue="{re.escape(queue)}"\}} (\S+)$', text, re.M)
    return {name: float(value) for name, value in found}


@pytest.mark.parametrize("broker_kind", ["redis", "rabbitmq"])
def test_depth_and_oldest_age_follow_what_is_sent_and_run_and_a_dead_run_is_counted(durable_scenario,
                                                                                      broker_kind):
    s, url = durable_scenario("postgresql", broker_kind)
    celery_durable.install(s.producer)  # the sender stamps each message's send time, as a user's app does
    q = s.by_name["q"]
    port = free_port()
    worker = s.worker(app=APP, conf=conf(url, durable_metrics_port=port), concurrency=1).wait_ready()
    assert queue_gauges(port, q) == {"job_queue_depth": 0.0, "job_queue_oldest_ready_seconds": 0.0,
                                     "job_queue_dead_runs": 0.0}

    holder = s.send_task("q", "durable.long_steps", ["hold", 6, 0.5])  # the one slot, for about 3 s
    wait_for(lambda: effects(url, holder).get("s0"), timeout=20, what="the holder's first step")
    waiting = [s.send_task("q", "durable.quick", [f"w{i}"]) for i in range(4)]
    first = wait_for(lambda: (g := queue_gauges(port, q)).get("job_queue_depth") == 4.0 and g, timeout=10,
                     what="a depth of 4 while the slot is held", every=0.05)
    # The oldest message ages while it waits: read again later, it is older by about as much.
    later = wait_for(lambda: (g := queue_gauges(port, q))["job_queue_oldest_ready_seconds"]
                     >= first["job_queue_oldest_ready_seconds"] + 0.5 and g,
                     timeout=10, what="the oldest ready age to grow", every=0.1)
    assert later["job_queue_depth"] == 4.0 and later["job_queue_oldest_ready_seconds"] < 10.0

    wait_for(lambda: all(run_state(url, run_id) == "succeeded" for run_id in waiting), timeout=30,
             what="the waiting runs to run")
    wait_for(lambda: queue_gauges(port, q).get("job_queue_depth") == 0.0, timeout=5, what="a depth of 0",
             every=0.1)
    assert queue_gauges(port, q)["job_queue_oldest_ready_seconds"] == 0.0

    doomed = s.send_task("q", "durable.doomed", ["doomed"])
    wait_for(lambda: run_state(url, doomed) == "dead", timeout=30, what="the doomed run to die")
    wait_for(lambda: queue_gauges(port, q).get("job_queue_dead_runs") == 1.0, timeout=5,
             what="one dead run on the queue", every=0.1)
    assert worker.terminate() == 0
