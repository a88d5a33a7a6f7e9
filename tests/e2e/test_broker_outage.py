"""A broker outage under real ``-P durable`` workers (through a proxy the test owns): claiming resumes after it."""

from __future__ import annotations

import time

import pytest

from tests.conftest import MESSAGE_BROKERS
from tests.e2e.durable_support import APP, conf, durable_scenario, run_state  # noqa: F401 - a fixture
from tests.e2e.harness import wait_for


@pytest.mark.long
@pytest.mark.parametrize("execution", ["threads", "prefork"])
@pytest.mark.parametrize("broker_kind", MESSAGE_BROKERS)
def test_a_worker_cut_off_from_its_broker_mid_run_claims_again_once_it_is_back(durable_scenario, fault_proxy,
                                                                               broker_kind, execution):
    s, url = durable_scenario("postgresql", broker_kind)
    proxy = fault_proxy(s.broker_url)
    worker = s.worker(app=APP, conf=conf(url, durable_execution=execution, durable_lease_ttl=2,
                                         broker_transport_options={"visibility_timeout": 5},
                                         durable_restore_interval=0.5),
                      concurrency=4, broker_url=proxy.url_for(s.broker_url)).wait_ready()
    ids = [s.send_task("q", "durable.long_steps", [f"run-{n}", 2, 0.6]) for n in range(24)]
    wait_for(lambda: len(s.labelled("exec", "run-")) >= 4, timeout=20, what="the first runs to start")
    proxy.outage()
    time.sleep(4.0)  # hold the outage open while the running ones finish and cannot ack
    proxy.restore()
    wait_for(lambda: all(run_state(url, run_id) == "succeeded" for run_id in ids), timeout=90,
             what="every run to succeed after the outage")
    assert worker.process.poll() is None
    assert worker.terminate() == 0
