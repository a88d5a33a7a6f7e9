"""A real ``celery worker -P durable`` on RabbitMQ serving many queues: skipped empty queues, late work, quorum queues.

The strict a, b, c turn among fifty queues runs on RabbitMQ in test_fairness_and_cap.py (every broker).
"""

from __future__ import annotations

import pytest
from kombu import Queue

from tests.e2e.harness import wait_for

pytestmark = pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)


def test_a_task_on_a_queue_the_worker_skips_as_empty_starts_within_the_bound(scenario):
    # The worker drains one queue among fifty and leaves the 49 it found empty out of its passes
    # (planning/known_ready.py: trusted empty for PROBED_EMPTY_FOR = 20 ms, then probed again).
    # 10 ms tasks on 2 slots: a message landing on a skipped queue starts once they are probed
    # again, within a few drain tasks; never left until the drain ends.
    names = [f"q{i:02d}" for i in range(50)]
    s = scenario(names)
    for i in range(600):
        s.send("q49", f"d{i}", 0.01)
    worker = s.worker(conf={"durable_max_in_flight": 2}, concurrency=2).wait_ready()
    for n, late_queue in enumerate(["q00", "q17", "q33"]):
        wait_for(lambda n=n: len(s.labelled("start", "d")) >= 40 * (n + 1), timeout=60,
                 what="the drain to be under way")
        before = len(s.labelled("start", "d"))
        s.send(late_queue, f"late{n}")
        late = wait_for(lambda n=n: s.labelled("start", f"late{n}"), timeout=60, what=f"late task {n} to start")[0]
        drained_meanwhile = [e for e in s.labelled("start", "d") if e["t"] < late["t"]]
        # 20 ms of trust + one 10 ms task per slot is ~6 drain starts; 25 leaves room for a loaded CI
        # machine, and is far short of the ~500 left in the drain.
        assert len(drained_meanwhile) - before < 25, (late_queue, before, len(drained_meanwhile))
        assert late["queue"] == s.by_name[late_queue]
    s.wait_ended(603, timeout=120)
    assert worker.terminate() == 0


def test_a_task_landing_on_a_watched_queue_starts_without_waiting_for_a_probe(scenario):
    # The probe's trust in an empty queue is raised to an hour: only the queue watch
    # (worker/queue_watch.py) can find a late task before the drain of q49 ends.
    names = [f"q{i:02d}" for i in range(50)]
    s = scenario(names)
    for i in range(600):
        s.send("q49", f"d{i}", 0.01)
    worker = s.worker(conf={"durable_max_in_flight": 2}, concurrency=2,
                      env={"E2E_PROBED_EMPTY_FOR": "3600"}).wait_ready()
    wait_for(lambda: len(s.labelled("start", "d")) >= 40, timeout=60, what="the drain to be under way")
    stats = worker.wait_durable(lambda d: s.by_name["q17"] in d["watching"], timeout=20,
                                what="q17 to be watched")
    before = len(s.labelled("start", "d"))
    s.send("q17", "late")
    late = wait_for(lambda: s.labelled("start", "late"), timeout=60, what="the late task to start")[0]
    drained_meanwhile = [e for e in s.labelled("start", "d") if e["t"] < late["t"]]
    # A pass with room gives the watch its credit at most every 5 ms; the message is pushed at once and
    # runs then, or goes back and is asked by the next pass. A few drain starts, never the ~500 left.
    assert len(drained_meanwhile) - before < 25, (before, len(drained_meanwhile))
    stats = worker.wait_durable(lambda d: d["claimed_by_watch"] + d["watch_given_back"] >= 1, timeout=10,
                                what="the watch to have been pushed the late task")
    assert stats["watch_credits"] >= 1, stats
    s.wait_ended(601, timeout=120)
    assert worker.terminate() == 0


def quorum_queue(name: str) -> Queue:
    return Queue(name, exchange=name, routing_key=name, durable=True,
                 queue_arguments={"x-queue-type": "quorum"})


def test_tasks_on_a_quorum_queue_run_and_are_acked(scenario):
    # A quorum queue answers the passive declare (the probe) and basic.get as a classic one does.
    # Its requeue order: RabbitMQ puts a message given back (basic.reject/nack with requeue) back
    # in its original place when it can, and for a quorum queue counts a reject towards its
    # delivery-limit (RabbitMQ 4.x: 20 by default; a message over it is dead-lettered or dropped).
    # A quorum queue on RabbitMQ 3.x without a delivery-limit returns it to the back instead: a run
    # the worker hands back (a drain, a pass that took beyond its room) then runs after newer
    # messages of its own queue. The turn across queues is the worker's rotation and does not change:
    # only the order within that one queue does. (docs/claiming.md, "Quorum queues")
    s = scenario(["qq", "plain"])
    queues = [quorum_queue(s.by_name["qq"]), Queue(s.by_name["plain"])]
    s.producer.conf.task_queues = queues
    with s.producer.connection_for_write() as conn:
        for queue in queues:
            queue(conn.default_channel).declare()
    for i in range(6):
        s.send("qq", f"a{i}", 0.01)
        s.send("plain", f"b{i}", 0.01)
    conf = {"durable_max_in_flight": 1,
            "task_queues": {s.by_name["qq"]: {"exchange": s.by_name["qq"], "routing_key": s.by_name["qq"],
                                              "durable": True,
                                              "queue_arguments": {"x-queue-type": "quorum"}},
                            s.by_name["plain"]: {"exchange": s.by_name["plain"],
                                                 "routing_key": s.by_name["plain"]}}}
    worker = s.worker(conf=conf, concurrency=1).wait_ready()
    s.wait_ended(12)
    order = [e["label"][0] for e in sorted(s.started(), key=lambda e: e["t"])]
    # Both queues backlogged at cap 1: the strict turn holds with a quorum queue in it.
    assert order in (list("ab" * 6), list("ba" * 6)), order
    # Idle, the worker waits on both queues at once: the quorum queue on a channel of its own, since
    # RabbitMQ refuses a global basic.qos there (NOT_IMPLEMENTED closes the whole connection).
    worker.wait_durable(lambda d: set(d["idle_waiting_on"]) == set(s.by_name.values()), timeout=20,
                        what="the idle wait on both queues")
    s.send("qq", "a-late", 0.01)
    s.wait_ended(13)
    assert worker.durable_stats()["claimed_by_idle_wait"] >= 1
    # Every run acked: nothing ready or held on the quorum queue once the worker has stopped.
    assert worker.terminate() == 0
    assert s.broker_depth("qq") == 0
    assert "NOT_IMPLEMENTED" not in worker.log()
    assert "Connection to broker lost" not in worker.log()


def test_messages_landing_on_two_idle_quorum_queues_at_once_each_run_once(scenario):
    # Each quorum queue's idle consumer has a prefetch of one of its own: both may deliver at once to a
    # worker with one slot. The one without a slot goes back in place and the next pass takes it.
    s = scenario(["q1", "q2"])
    queues = [quorum_queue(s.by_name[name]) for name in ("q1", "q2")]
    s.producer.conf.task_queues = queues
    with s.producer.connection_for_write() as conn:
        for queue in queues:
            queue(conn.default_channel).declare()
    conf = {"durable_max_in_flight": 1,
            "task_queues": {queue.name: {"exchange": queue.name, "routing_key": queue.name, "durable": True,
                                         "queue_arguments": {"x-queue-type": "quorum"}} for queue in queues}}
    worker = s.worker(conf=conf, concurrency=1).wait_ready()
    for round_ in range(5):
        worker.wait_durable(lambda d: set(d["idle_waiting_on"]) == set(s.by_name.values()), timeout=20,
                            what="the idle wait on both queues")
        s.send("q1", f"one{round_}", 0.02)
        s.send("q2", f"two{round_}", 0.02)
        s.wait_ended(2 * (round_ + 1))
    assert s.max_concurrency() == 1
    assert worker.terminate() == 0
    assert sorted(e["label"] for e in s.started()) == sorted(f"{n}{i}" for i in range(5) for n in ("one", "two"))
    assert s.broker_depth("q1") == 0 and s.broker_depth("q2") == 0
    assert "NOT_IMPLEMENTED" not in worker.log()
    assert "Connection to broker lost" not in worker.log()
