"""ETA/countdown runs are counted while they wait but hold no slot until they are due."""

from __future__ import annotations

from tests.e2e.harness import wait_for


def test_a_waiting_countdown_does_not_fill_the_worker(scenario):
    s = scenario(["q"])
    worker = s.worker(conf={"durable_max_in_flight": 1}, concurrency=1).wait_ready()
    later = s.send("q", "later", 0.0, countdown=4)
    stats = worker.wait_durable(lambda st: st["scheduled"] == 1, timeout=20, what="the countdown run held")
    assert stats["in_flight"] == 0
    for i in range(3):
        s.send("q", f"now{i}", 0.1)
    s.wait_ended(3, timeout=20)
    assert [e["label"] for e in s.ended()] == ["now0", "now1", "now2"], "the countdown blocked the worker"
    ended = s.wait_ended(4, timeout=20)
    assert ended[-1]["id"] == later
    worker.wait_durable(lambda st: st["scheduled"] == 0 and st["in_flight"] == 0, timeout=20,
                        what="every count back")
    assert worker.terminate() == 0


def test_a_run_falling_due_on_a_full_worker_waits_for_a_slot_and_goes_first(scenario):
    s = scenario(["q"])
    worker = s.worker(conf={"durable_max_in_flight": 1}, concurrency=1).wait_ready()
    s.send("q", "due", 0.0, countdown=1)
    worker.wait_durable(lambda st: st["scheduled"] == 1, timeout=20, what="the countdown run held")
    s.send("q", "long", 3.0)
    wait_for(lambda: any(e["label"] == "long" for e in s.started()), timeout=20, what="the long run to start")
    s.send("q", "queued", 0.0)
    s.wait_ended(3, timeout=30)
    # The cap held (never two at once), and the run that fell due while the
    # worker was full went before the message still in the broker.
    assert s.max_concurrency() == 1
    assert [e["label"] for e in sorted(s.started(), key=lambda e: e["t"])] == ["long", "due", "queued"]
    worker.wait_durable(lambda st: st["scheduled"] == 0 and st["in_flight"] == 0, timeout=20,
                        what="every count back")
    assert worker.terminate() == 0
