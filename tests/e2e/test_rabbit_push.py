"""RabbitMQ, one open queue: the broker pushes with a credit of the worker's room, never buffering beyond it.

Push is on where tasks ack late (worker/push_consumer.py says why): these workers set ``task_acks_late``.
Prefork and thread execution both push: under threads the run's late ack is written by the loop thread
after the pool thread gave its slot back, which the credit counts for (worker/push_consumer.py).
"""

from __future__ import annotations

import pytest
from kombu import Queue

from tests.e2e.harness import wait_for

pytestmark = pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)

EXECUTIONS = pytest.mark.parametrize("execution", ["prefork", "threads"])


@EXECUTIONS
def test_one_queue_is_pushed_and_the_broker_keeps_all_but_the_room(scenario, execution):
    s = scenario(["work"])
    for i in range(12):
        s.send_waiting("work", f"w{i}")
    worker = s.worker(conf={"durable_max_in_flight": 3, "task_acks_late": True, "durable_execution": execution},
                      concurrency=3).wait_ready()
    queue = s.by_name["work"]
    stats = worker.wait_durable(lambda d: d["claim_pushing"] == queue and d["claimed_by_push"] >= 3,
                                timeout=20, what="the queue to be pushed")
    for opened in range(4):
        wait_for(lambda opened=opened: len(s.started()) == 3 + opened, timeout=20, what=f"{3 + opened} runs to start")
        # Every run that started holds its slot until its gate opens: the broker keeps the rest.
        assert s.broker_depth("work") == 12 - 3 - opened
        s.open_gate()
    wait_for(lambda: len(s.started()) == 7, timeout=20, what="7 runs to start")
    assert s.broker_depth("work") == 5
    assert stats["claimed_by_passes"] + stats["claimed_by_idle_wait"] < 3  # the push took them
    s.open_gate(count=12 - 4)
    s.wait_ended(12, timeout=30)
    assert s.max_concurrency() == 3
    assert worker.terminate() == 0
    assert sorted(e["label"] for e in s.started()) == sorted(f"w{i}" for i in range(12))  # each ran once


def test_a_queue_leaving_its_cap_gets_its_turn_from_a_pushed_queue(scenario):
    # `a` at its one slot leaves `b` the only open queue: pushed. When `a`'s run ends both are open,
    # and the rotated turn gives `a`'s waiting task the next slot, long before `b`'s backlog drains.
    s = scenario(["a", "b"])
    s.send_waiting("a", "a0", gate="a")
    worker = s.worker(conf={"durable_max_in_flight": 1, "task_acks_late": True,
                                        "durable_queue_concurrency": {s.by_name["a"]: 1}},
                      concurrency=1).wait_ready()
    wait_for(lambda: s.labelled("start", "a0"), timeout=20, what="a0 to start")
    for i in range(40):
        s.send("b", f"b{i}", 0.05)
    s.send("a", "a1")
    b = s.by_name["b"]
    # a0 holds the one slot: no room, so neither queue is open and nothing is taken.
    assert s.broker_depth("b") == 40
    s.open_gate("a")
    wait_for(lambda: s.labelled("start", "a1"), timeout=20, what="a1 to start")
    b_before_a1 = [e for e in s.started() if e["label"].startswith("b") and e["t"] < s.labelled("start", "a1")[0]["t"]]
    assert len(b_before_a1) <= 1, b_before_a1  # a1 had the next turn after the one b took, if any
    # With `a` empty and below its cap both stay open: the rotated turn goes on (no push).
    assert worker.durable_stats()["claim_pushing"] in (None, b)
    s.wait_ended(42, timeout=60)
    assert s.max_concurrency() == 1
    assert worker.terminate() == 0


def test_pushed_then_pushed_elsewhere_when_the_other_queue_is_at_its_cap(scenario):
    s = scenario(["a", "b"])
    s.send_waiting("a", "a0", gate="a")
    worker = s.worker(conf={"durable_max_in_flight": 2, "task_acks_late": True,
                                        "durable_queue_concurrency": {s.by_name["a"]: 1}},
                      concurrency=2).wait_ready()
    wait_for(lambda: s.labelled("start", "a0"), timeout=20, what="a0 to start")
    b = s.by_name["b"]
    worker.wait_durable(lambda d: d["claim_pushing"] == b, timeout=20, what="b, the one open queue, to be pushed")
    for i in range(5):
        s.send_waiting("b", f"b{i}", gate="b")
    wait_for(lambda: s.labelled("start", "b0"), timeout=20, what="b0 to start")
    assert s.broker_depth("b") == 4  # room 1: one pushed, the rest kept
    s.send_waiting("a", "a1", gate="a")
    s.open_gate("a")
    wait_for(lambda: s.labelled("start", "a1"), timeout=20, what="a1 to start")
    # a1 holds the slot a0 freed (a, open again beside b, had the turn): b's credit stayed 0.
    assert s.broker_depth("b") == 4
    s.open_gate("a")
    s.open_gate("b", count=5)
    s.wait_ended(7, timeout=30)
    assert worker.terminate() == 0


def test_early_acks_keep_the_rotated_basic_get(scenario):
    s = scenario(["work"])
    for i in range(6):
        s.send("work", f"w{i}")
    worker = s.worker(conf={"durable_max_in_flight": 2}, concurrency=2).wait_ready()
    s.wait_ended(6, timeout=30)
    stats = worker.durable_stats()
    assert (stats["claim_pushing"], stats["claimed_by_push"]) == (None, 0)
    assert worker.terminate() == 0


@EXECUTIONS
def test_acks_late_warm_shutdown_gives_back_nothing_twice(scenario, execution):
    s = scenario(["work"])
    for i in range(10):
        s.send_waiting("work", f"w{i}")
    worker = s.worker(conf={"durable_max_in_flight": 2, "task_acks_late": True, "durable_execution": execution},
                      concurrency=2).wait_ready()
    wait_for(lambda: len(s.started()) == 2, timeout=20, what="2 runs to start")
    worker.process.send_signal(15)  # SIGTERM: a warm shutdown; the two runs finish, nothing more is taken
    wait_for(lambda: "durable.drain.started" in worker.log(), timeout=20, what="the drain to begin")
    s.open_gate(count=2)
    assert worker.terminate() == 0
    # A message settled twice (a double ack or reject) closes the channel with PRECONDITION_FAILED and
    # requeues what it held: the two runs would be in the broker again.
    assert "PRECONDITION_FAILED" not in worker.log()
    assert "unknown delivery tag" not in worker.log()
    assert s.broker_depth("work") == 8
    assert sorted(e["label"] for e in s.ended()) == sorted(e["label"] for e in s.started())
    assert len(s.started()) == 2


def test_a_quorum_queue_alone_is_claimed_with_basic_get_not_pushed(scenario):
    # The push channel's credit is a global basic.qos, which RabbitMQ refuses for a consumer of a quorum
    # queue with NOT_IMPLEMENTED, closing the worker's whole connection: the one open queue stays in the turn.
    s = scenario(["qq"])
    name = s.by_name["qq"]
    queue = Queue(name, exchange=name, routing_key=name, durable=True, queue_arguments={"x-queue-type": "quorum"})
    s.producer.conf.task_queues = [queue]
    with s.producer.connection_for_write() as conn:
        queue(conn.default_channel).declare()
    for i in range(8):
        s.send("qq", f"q{i}", 0.01)
    conf = {"durable_max_in_flight": 2, "task_acks_late": True,
            "task_queues": {name: {"exchange": name, "routing_key": name, "durable": True,
                                   "queue_arguments": {"x-queue-type": "quorum"}}}}
    worker = s.worker(conf=conf, concurrency=2).wait_ready()
    s.wait_ended(8, timeout=30)
    stats = worker.durable_stats()
    assert (stats["claim_pushing"], stats["claimed_by_push"]) == (None, 0)
    assert "NOT_IMPLEMENTED" not in worker.log()
    assert "Connection to broker lost" not in worker.log()
    assert worker.terminate() == 0
    assert s.broker_depth("qq") == 0
    assert sorted(e["label"] for e in s.started()) == sorted(f"q{i}" for i in range(8))  # each ran once
