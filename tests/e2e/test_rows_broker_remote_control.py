"""Remote control and task events on the broker that claims rows, PostgreSQL and SQLite, as on Redis: a real
``-P durable -E`` worker answers ``inspect`` and ``control``, takes a broadcast ``revoke``, and a monitor in
another process (as ``celery events`` or Flower) receives its task events."""

from __future__ import annotations

import threading
from typing import Any

from tests.e2e.harness import Scenario, wait_for
from tests.e2e.test_deployment_fit import active_queues, control

TTL = 3.0


def test_a_durable_worker_answers_inspect_and_control_takes_a_revoke_and_sends_task_events(
        row_broker: Scenario) -> None:
    s = row_broker
    a, b = s.by_name["a"], s.by_name["b"]
    events: list[dict[str, Any]] = []
    with s.producer.connection_for_read() as conn:
        receiver = s.producer.events.Receiver(conn, handlers={"*": events.append})
        monitor = threading.Thread(target=receiver.capture, kwargs={"limit": None, "timeout": None}, daemon=True)
        monitor.start()
        try:
            worker = s.worker(concurrency=2, queues=["a"], extra_args=["-E"],
                              conf={"durable_lease_ttl": TTL}).wait_ready()
            replies = s.producer.control.inspect(destination=[worker.hostname], timeout=5).ping()
            assert replies == {worker.hostname: {"ok": "pong"}}
            assert worker.durable_stats()["capacity"] == 2

            assert control(s, worker, "add_consumer", queue=b).get("ok")
            wait_for(lambda: active_queues(s, worker) == sorted([a, b]), timeout=10,
                     what="b among the active queues", every=0.2)
            assert control(s, worker, "pool_grow", n=1).get("ok")
            worker.wait_durable(lambda d: d["capacity"] == 3, timeout=10, what="capacity 3 after pool_grow")
            assert control(s, worker, "pool_shrink", n=1).get("ok")
            worker.wait_durable(lambda d: d["capacity"] == 2, timeout=10, what="capacity 2 after pool_shrink")

            # A countdown rides the row's visible_at: the worker learns of the revoke by broadcast before
            # the row is due, and discards it when it claims it.
            doomed = s.send("a", "revoked", countdown=2)
            s.producer.control.revoke(doomed)
            after = s.send("b", "after", countdown=2.5)
            wait_for(lambda: s.labelled("end", "after"), timeout=30, what="the task sent after the revoke to run")
            wait_for(lambda: doomed in worker.log() and "revoked" in worker.log().lower(), timeout=10,
                     what="the revoked task to be discarded")
            assert not s.labelled("start", "revoked"), "a revoked task ran"

            wait_for(lambda: {"task-received", "task-started", "task-succeeded"}
                     <= {e["type"] for e in events if e.get("uuid") == after},
                     timeout=10, what="the monitor to see the task's received, started and succeeded events")
            assert any(e["type"] == "worker-heartbeat" and e["hostname"] == worker.hostname for e in events)
            assert worker.terminate() == 0
        finally:
            receiver.should_stop = True
            monitor.join(timeout=10)
