"""Per-queue slots, head-of-line blocking, crash redelivery and the SIGTERM drain, on real workers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.conftest import ALL_BROKERS
from tests.e2e.harness import wait_for


def test_a_queue_at_its_slots_never_runs_more_and_other_queues_keep_running(scenario):
    s = scenario(["reports", "emails"])
    for i in range(20):
        s.send("reports", f"report{i}", 0.5)
    for i in range(10):
        s.send("emails", f"email{i}", 0.05)
    worker = s.worker(
        conf={"durable_max_in_flight": 4, "durable_queue_concurrency": {s.by_name["reports"]: 2}},
        concurrency=4,
    ).wait_ready()
    s.wait_ended(30, timeout=60)
    events = s.events()
    is_report = lambda e: e["label"].startswith("report")  # noqa: E731
    assert s.max_concurrency(events, only=is_report) == 2
    # The emails ran beside the reports, not after them.
    last_email_end = max(e["t"] for e in events if e["e"] == "end" and not is_report(e))
    report_ends = sorted(e["t"] for e in events if e["e"] == "end" and is_report(e))
    assert last_email_end < report_ends[len(report_ends) // 2], "emails waited behind the reports"
    assert worker.terminate() == 0


def _head_of_line(s, *, pool: str, conf: dict, long_seconds: float) -> tuple[float, int]:
    """Two -c 1 workers; one long task then twelve short ones: worst short wait, and shorts run."""
    workers = [s.worker(pool=pool, conf=conf, concurrency=1).wait_ready() for _ in range(2)]
    sent: dict[str, float] = {}
    sent["long"] = time.time()
    s.send("q", "long", long_seconds)
    wait_for(lambda: any(e["label"] == "long" for e in s.started()), timeout=20, what="the long task to start")
    for i in range(12):
        label = f"short{i}"
        sent[label] = time.time()
        s.send("q", label, 0.1)
    s.wait_ended(13, timeout=60)
    waits = [e["t"] - sent[e["label"]] for e in s.started() if e["label"].startswith("short")]
    for worker in workers:
        worker.terminate()
    return max(waits), len(waits)


def test_no_short_task_waits_behind_a_long_one(scenario):
    s = scenario(["q"])
    worst, count = _head_of_line(s, pool="durable", conf={"task_acks_late": True}, long_seconds=3.0)
    assert count == 12
    # Twelve 0.1 s tasks on the one free worker take about 1.2 s; none waits for the 3 s task.
    assert worst < 2.2, f"a short task waited {worst:.2f}s"


def test_stock_prefetch_makes_a_short_task_wait_behind_the_long_one(scenario):
    # The contrast that makes the test above mean something: stock Celery,
    # default prefetch, same scenario.
    s = scenario(["q"])
    worst, count = _head_of_line(s, pool="prefork", conf={}, long_seconds=3.0)
    assert count == 12
    assert worst > 2.5, f"stock Celery's worst short wait was only {worst:.2f}s"


def test_acks_late_run_of_a_killed_worker_is_redelivered_and_runs(scenario, broker):
    s = scenario(["q"])
    conf = {
        "task_acks_late": True,
        # Kombu's visibility timeout left at its hour: the victim's heartbeat stopping is what counts.
        "durable_lease_ttl": 3,
    }
    first = s.worker(conf=conf, concurrency=1).wait_ready()
    task_id = s.send("q", "victim", 2.0)
    wait_for(lambda: s.started(), timeout=20, what="the task to start")
    first.kill()
    assert s.ended() == []
    # The new worker gets the message back: RabbitMQ requeues it when the
    # connection drops; on Redis the durable worker restores it itself once
    # the victim's heartbeat is a lease TTL old.
    second = s.worker(conf=conf, concurrency=1).wait_ready()
    ended = s.wait_ended(1, timeout=30)
    starts = [e for e in s.started() if e["id"] == task_id]
    assert len(starts) == 2
    assert ended[0]["id"] == task_id
    assert second.terminate() == 0


def test_a_message_handed_to_an_idle_worker_as_it_is_killed_is_run_by_another(scenario, broker):
    # Before, on Redis: the idle wait was kombu's BRPOP, which takes a message off its list the moment
    # it arrives; a worker killed before its loop read the reply took the only copy with it (never
    # run, not in the queue, not unacked). The killed holder of issue 11 lost one so, 1 run in 6.
    s = scenario(["q"])
    victim = s.worker(concurrency=1).wait_ready()
    victim.wait_durable(lambda d: d["idle_waiting_on"] == [s.by_name["q"]], timeout=10,
                        what="the victim's idle wait to be armed on q")
    # Stopped, its loop reads nothing more: whatever Redis or RabbitMQ hands it stays in its socket.
    os.kill(victim.process.pid, signal.SIGSTOP)
    task_id = s.send("q", "handed-to-the-victim")
    victim.kill()
    s.worker(concurrency=1).wait_ready()
    ended = s.wait_ended(1, timeout=30)
    assert [e["id"] for e in ended] == [task_id]


@pytest.mark.parametrize("broker", ALL_BROKERS, indirect=True)
@pytest.mark.parametrize("acks_late", [True, False], ids=["acks_late", "early_ack"])
def test_sigterm_lets_held_runs_finish_and_leaves_the_rest_in_the_broker(scenario, acks_late):
    s = scenario(["q"])
    for i in range(8):
        s.send("q", f"t{i}", 1.0)
    # acks_late: the runs finishing during the drain are acked then, on the connection Celery keeps open
    # until the pool is joined (their acks were once skipped as if the connection were lost, and the
    # messages of finished runs were restored at close: the depth below counted them again).
    conf = {"durable_max_in_flight": 3, "durable_drain_timeout": 30, "task_acks_late": acks_late}
    worker = s.worker(conf=conf, concurrency=3).wait_ready()
    wait_for(lambda: len(s.started()) >= 3, timeout=20, what="three runs to start")
    started_at_term = len(s.started())
    assert worker.terminate(timeout=30) == 0
    assert len(s.started()) == started_at_term, "claimed after SIGTERM"
    assert len(s.ended()) == started_at_term, "a held run did not finish"
    assert s.broker_depth("q") == 8 - started_at_term


@pytest.mark.parametrize("broker", ALL_BROKERS, indirect=True)
@pytest.mark.parametrize("acks_late", [True, False], ids=["acks_late", "early_ack"])
def test_sigterm_deadline_hands_unfinished_runs_back_without_burning_an_attempt(scenario, acks_late):
    s = scenario(["q"])
    for i in range(2):
        s.send("q", f"slow{i}", 4.0)
    conf = {"durable_max_in_flight": 2, "durable_drain_timeout": 0.5, "task_acks_late": acks_late}
    worker = s.worker(conf=conf, concurrency=2).wait_ready()
    wait_for(lambda: len(s.started()) >= 2, timeout=20, what="both runs to start")
    began = time.monotonic()
    assert worker.terminate(timeout=30) == 0
    assert time.monotonic() - began < 3.5, "the drain did not stop at its deadline"
    assert s.ended() == []
    wait_for(lambda: s.broker_depth("q") == 2, timeout=10, what="both runs back in the broker")
    again = s.worker(conf={"durable_max_in_flight": 2}, concurrency=2).wait_ready()
    ended = s.wait_ended(2, timeout=30)
    assert sorted(e["label"] for e in ended) == ["slow0", "slow1"]
    reruns = s.started()[2:]
    assert [e["retries"] for e in reruns] == [0, 0], "the hand-back burned an attempt"
    assert again.terminate() == 0


def test_thread_drain_hands_back_what_has_not_started_and_waits_for_running_threads(scenario):
    s = scenario(["q"])
    for i in range(2):
        s.send("q", f"running{i}", 2.0)
    # An ETA far enough away that it is still waiting at the deadline: held, not started.
    s.send("q", "waiting", 0.0, countdown=30)
    conf = {"durable_max_in_flight": 3, "durable_drain_timeout": 0.5, "durable_execution": "threads"}
    worker = s.worker(conf=conf, concurrency=3).wait_ready()
    wait_for(lambda: len(s.started()) >= 2, timeout=20, what="both runs to start")
    wait_for(lambda: s.broker_depth("q") == 0, timeout=10, what="the ETA message to be claimed")
    assert worker.terminate(timeout=30) == 0
    # The running threads were waited for, not handed back (that would run them twice)...
    assert sorted(e["label"] for e in s.ended()) == ["running0", "running1"]
    # ...and the run that had not started went back to the broker.
    wait_for(lambda: s.broker_depth("q") == 1, timeout=10, what="the waiting run back in the broker")
