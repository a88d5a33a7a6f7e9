"""A task id the runs table cannot hold, on a real ``-P durable`` worker: a dead letter naming it, no retry."""

from __future__ import annotations

import pytest

from tests.e2e.durable_support import APP, conf, durable_scenario  # noqa: F401 - a fixture
from tests.e2e.harness import wait_for


@pytest.mark.parametrize(("task_id", "shown"), [
    ("x" * 300, "is 300 characters; at most 255"),
    ("order-\x00-7", "contains a NUL character"),
])
def test_a_task_id_the_store_cannot_hold_is_dead_lettered_naming_it(durable_scenario, task_id, shown):
    s, url = durable_scenario("postgresql", "redis")
    worker = s.worker(app=APP, conf=conf(url), concurrency=1).wait_ready()
    s.send_task("q", "durable.quick", ["bad-id"], task_id=task_id)
    wait_for(lambda: "durable.run.id_invalid" in worker.log(), timeout=20, what="the bad id to be dead-lettered")
    line = next(x for x in worker.log().splitlines() if "durable.run.id_invalid" in x)
    assert shown in line and "durable.quick" in line
    wait_for(lambda: any(e["e"] == "settled" for e in s.events()), timeout=10, what="on_settled")
    settled = [e for e in s.events() if e["e"] == "settled"]
    assert [(e["state"], "RunIdInvalid" in e["error"]) for e in settled] == [("dead", True)]
    assert not s.labelled("start", "bad-id"), "the body ran"
    # Buried at once: no retry was sent, and nothing is left on the queue.
    assert "Retry in" not in worker.log()
    wait_for(lambda: s.broker_depth("q") == 0, timeout=10, what="the message to be acked")
    # A good run right after shows the worker carries on.
    good = s.send_task("q", "durable.quick", ["good"])
    wait_for(lambda: s.labelled("end", "good"), timeout=20, what="a good run after the bad one")
    assert good and worker.process.poll() is None
    assert worker.terminate() == 0
