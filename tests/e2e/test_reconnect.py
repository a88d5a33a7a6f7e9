"""A lost broker connection: runs the pool did not have yet go back, and so do their counts."""

from __future__ import annotations

import pytest

from tests.e2e.harness import wait_for


# RabbitMQ only: Redis keeps unacked messages server-side and redis-py
# reconnects under kombu, so a dropped Redis socket loses no held run.
@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_runs_waiting_at_a_lost_rabbitmq_connection_are_redelivered_and_their_counts_returned(scenario, broker):
    # Through the test's own proxy: only this test's connections are cut, not every client's of
    # the shared broker.
    s = scenario(["q"], proxied=True)
    worker = s.worker(conf={"durable_max_in_flight": 2}, concurrency=2).wait_ready()
    # Sent once the worker is up: sent before, they fell due while a loaded machine started it, and ran at once.
    ids = [s.send("q", f"eta{i}", 0.0, countdown=3) for i in range(2)]
    worker.wait_durable(lambda st: st["scheduled"] == 2, timeout=20, what="both ETA runs held")
    connected = worker.log().count("Connected to amqp")
    s.proxy.drop_connections()
    s.reconnect_producer()
    wait_for(lambda: worker.log().count("Connected to amqp") > connected, timeout=60,
             what="the worker to reconnect")
    # The broker redelivers both; the reconnected worker has room for them.
    s.wait_ended(2, timeout=60)
    assert sorted(e["id"] for e in s.ended()) == sorted(ids)
    # Without the hand-back on close, the dropped runs would stay counted for good.
    worker.wait_durable(lambda st: st["in_flight"] == 0 and st["scheduled"] == 0, timeout=20,
                        what="the counts to come back")
    for i in range(2):
        s.send("q", f"after{i}", 0.5)
    s.wait_ended(4, timeout=30)
    after = [e for e in s.events() if e["label"].startswith("after")]
    assert s.max_concurrency(after) == 2
    assert worker.terminate() == 0
