"""A real ``celery worker -P durable`` counts every run it holds, and gives each count back exactly once.

Every path a claimed message can take — ETA/countdown, rate limit, retry, revoke
before the claim and while an ETA waits, ``Reject``, a hard time limit kill, an
unknown task name, an expired message — must end with ``inspect stats``
showing nothing held, and the worker must still run new work at its full
capacity, never above it. A count never returned would shrink the worker for
good; a count returned twice would let it hold more than its cap.
"""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from tests.conftest import MESSAGE_BROKERS
from tests.e2e.harness import Scenario, WorkerProcess, wait_for

#: What every test waits at most for a count to come back once its work is done.
SETTLE_SECONDS = 15.0


# -- helpers ------------------------------------------------------------------------------


def capped_worker(s: Scenario, cap: int = 2, **conf: Any) -> WorkerProcess:
    """A prefork worker whose pool is the cap: capacity == cap."""
    return s.worker(conf={"durable_max_in_flight": cap, **conf}, concurrency=cap).wait_ready()


def assert_settled(s: Scenario, worker: WorkerProcess, what: str) -> dict[str, Any]:
    """Nothing held any more, on any queue; the strategy's signals never failed in our receivers."""
    stats = worker.wait_durable(
        lambda d: d["in_flight"] == 0 and d["scheduled"] == 0 and not any(d["held_by_queue"].values()),
        timeout=SETTLE_SECONDS, what=f"every count to come back after {what}",
    )
    # A receiver of task_received/task_revoked that raised is logged by the
    # signal and swallowed: the count it should have returned leaks silently.
    assert "Signal handler" not in worker.log(), worker.log()[-3000:]
    return stats


def assert_full_capacity(s: Scenario, worker: WorkerProcess, cap: int, queue_name: str = "q",
                         tag: str = "full") -> None:
    """``cap`` long runs start together, the next waits in the broker, and it all settles again."""
    prefix = f"{tag}-"
    for i in range(cap + 1):
        s.send_waiting(queue_name, f"{prefix}{i}", gate=tag)
    wait_for(lambda: len(s.labelled("start", prefix)) >= cap, timeout=20,
             what=f"{cap} new runs to start together after the paths under test")
    stats = worker.wait_durable(lambda d: d["in_flight"] == cap, timeout=10,
                                what=f"in_flight == {cap} with {cap} runs started")
    assert stats["in_flight"] == cap
    # The one over the cap was not claimed: it is still the broker's.
    assert s.broker_depth(queue_name) == 1
    assert len(s.labelled("start", prefix)) == cap, s.labelled("start", prefix)
    s.open_gate(tag, cap + 1)
    wait_for(lambda: len(s.labelled("end", prefix)) == cap + 1, timeout=20,
             what=f"the {cap + 1} capacity runs to end")
    assert s.max_concurrency(only=lambda e: e["label"].startswith(prefix)) == cap
    assert_settled(s, worker, "the capacity runs")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        match = re.match(r"^(job_worker_\w+) ([0-9.eE+-]+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


# -- (a) ETA / countdown -----------------------------------------------------------------


def test_countdown_tasks_run_after_their_eta_and_give_their_counts_back(scenario):
    s = scenario(["q"])
    worker = capped_worker(s, 2)
    sent_at = time.time()
    for i in range(3):
        s.send("q", f"eta{i}", countdown=1)
    ended = s.wait_ended(3, timeout=20)
    assert sorted(e["label"] for e in ended) == ["eta0", "eta1", "eta2"]
    for event in s.started():
        assert event["t"] >= sent_at + 0.9, (event, sent_at)
    assert_settled(s, worker, "three countdown tasks")
    assert_full_capacity(s, worker, 2)


# -- (b) rate limit ------------------------------------------------------------------------


def test_rate_limited_tasks_all_run_and_give_their_counts_back(scenario):
    s = scenario(["q"])
    worker = capped_worker(s, 2)
    for i in range(6):
        s.send_task("q", "e2e.limited", [f"lim{i}"])
    wait_for(lambda: len(s.labelled("end", "lim")) == 6, timeout=20, what="6 rate-limited tasks to end")
    starts = sorted(e["t"] for e in s.labelled("start", "lim"))
    assert len(starts) == 6
    # 5/s with a bucket of one: the sixth starts about 1s after the first.
    assert starts[-1] - starts[0] >= 0.8, starts
    assert_settled(s, worker, "six rate-limited tasks")
    assert_full_capacity(s, worker, 2)


# -- (c) retries -------------------------------------------------------------------------------


def test_a_task_retried_twice_then_succeeding_gives_back_each_attempt(scenario):
    s = scenario(["q"])
    worker = capped_worker(s, 2)
    for label in ("flaky0", "flaky1"):
        s.send_task("q", "e2e.flaky", [label, 2])
    wait_for(lambda: len(s.labelled("end", "flaky")) == 2, timeout=30, what="both retried tasks to succeed")
    for label in ("flaky0", "flaky1"):
        starts = s.labelled("start", label)
        assert [e["retries"] for e in starts] == [0, 1, 2], starts
        assert [e["attempt"] for e in s.labelled("end", label)] == [3]
    assert_settled(s, worker, "two tasks retried twice each")
    assert_full_capacity(s, worker, 2)


# -- (d) revoke before the claim --------------------------------------------------------------


def test_a_task_revoked_while_queued_never_runs_and_gives_its_count_back(scenario):
    s = scenario(["q"])
    worker = capped_worker(s, 1)
    s.send_waiting("q", "blocker", gate="block")
    wait_for(lambda: s.labelled("start", "blocker"), timeout=20, what="the blocker to start")
    victim = s.send("q", "victim")
    # At its cap the worker claims nothing: the victim waits in the broker.
    worker.wait_durable(lambda d: d["in_flight"] == 1, timeout=10, what="the blocker to be held")
    assert s.broker_depth("q") == 1
    replies = s.producer.control.revoke(victim, destination=[worker.hostname], reply=True, timeout=5, limit=1)
    assert replies, "the worker did not acknowledge the revoke"
    s.open_gate("block")
    # FIFO at cap 1: once a task sent after the victim ran, the victim was claimed and discarded.
    s.send("q", "after")
    wait_for(lambda: s.labelled("end", "after"), timeout=20, what="the task after the victim to run")
    assert not s.labelled("start", "victim"), s.events()
    assert f"Discarding revoked task: e2e.record[{victim}]" in worker.log()
    assert s.broker_depth("q") == 0
    assert_settled(s, worker, "a revoked queued task")
    assert_full_capacity(s, worker, 1)


# -- (e) revoke while an ETA waits ------------------------------------------------------------


def test_an_eta_task_revoked_while_it_waits_never_runs_and_gives_its_count_back(scenario):
    s = scenario(["q"])
    worker = capped_worker(s, 2)
    victim = s.send("q", "victim", countdown=3)
    # Claimed and held in the worker's timer: counted as scheduled (it holds no slot until due).
    worker.wait_durable(lambda d: d["scheduled"] == 1 and d["in_flight"] == 0, timeout=10,
                        what="the ETA task to be held")
    assert s.broker_depth("q") == 0
    replies = s.producer.control.revoke(victim, destination=[worker.hostname], reply=True, timeout=5, limit=1)
    assert replies, "the worker did not acknowledge the revoke"
    # Sent after the victim with the same countdown: its timer fires after the victim's.
    s.send("q", "after", countdown=3)
    wait_for(lambda: s.labelled("end", "after"), timeout=20, what="the ETA task sent after the victim to run")
    assert not s.labelled("start", "victim"), s.events()
    assert_settled(s, worker, "a revoked ETA task")
    assert_full_capacity(s, worker, 2)


# -- revoke while waiting for a rate-limit token, revoke that terminates a run -------------------


def test_a_task_revoked_while_it_waits_for_a_rate_limit_token_gives_its_count_back(scenario):
    s = scenario(["q"])
    worker = capped_worker(s, 2)
    s.send_task("q", "e2e.limited_slow", ["first"])
    victim = s.send_task("q", "e2e.limited_slow", ["victim"])
    # One every 2s: the first runs, the victim is held in the task's token bucket.
    wait_for(lambda: s.labelled("end", "first"), timeout=20, what="the first rate-limited task to run")
    worker.wait_durable(lambda d: d["in_flight"] == 1, timeout=10, what="the victim to be held in its bucket")
    assert s.broker_depth("q") == 0
    replies = s.producer.control.revoke(victim, destination=[worker.hostname], reply=True, timeout=5, limit=1)
    assert replies, "the worker did not acknowledge the revoke"
    assert not s.labelled("start", "victim"), "the token came before the revoke: the test proves nothing"
    # Its token comes about 2s after the first: then it is discarded, not run.
    assert_settled(s, worker, "a task revoked in its token bucket")
    assert f"Discarding revoked task: e2e.limited_slow[{victim}]" in worker.log()
    assert not s.labelled("start", "victim"), s.events()
    assert_full_capacity(s, worker, 2)


def test_a_running_task_revoked_with_terminate_gives_its_count_back_once(scenario):
    s = scenario(["q"])
    worker = capped_worker(s, 2)
    victim = s.send_waiting("q", "victim", gate="never")
    wait_for(lambda: s.labelled("start", "victim"), timeout=20, what="the victim to start")
    worker.wait_durable(lambda d: d["in_flight"] == 1, timeout=10, what="the victim to be held")
    replies = s.producer.control.revoke(victim, destination=[worker.hostname], terminate=True,
                                        signal="SIGKILL", reply=True, timeout=5, limit=1)
    assert replies, "the worker did not acknowledge the revoke"
    assert_settled(s, worker, "a run terminated by revoke")
    assert not s.labelled("end", "victim")
    assert_full_capacity(s, worker, 2)


# -- (f) Reject(requeue=False) -------------------------------------------------------------------


# On each transport: the claimed message is settled by a reject, not an ack (on Redis, of the unacked record our
# claim script wrote; on RabbitMQ, basic.reject on the channel that claimed it), and must not come back.
@pytest.mark.parametrize("broker", MESSAGE_BROKERS, indirect=True)
def test_a_task_rejecting_its_message_gives_its_count_back_and_is_not_requeued(scenario):
    s = scenario(["q"])
    worker = capped_worker(s, 2)
    for i in range(3):
        s.send_task("q", "e2e.reject", [f"rej{i}"])
    wait_for(lambda: len(s.labelled("reject", "rej")) == 3, timeout=20, what="3 tasks to reject")
    assert_settled(s, worker, "three rejected tasks")
    assert_full_capacity(s, worker, 2)
    # Not requeued: each ran once, nothing is left in the broker.
    assert len(s.labelled("start", "rej")) == 3
    assert s.broker_depth("q") == 0


# -- (g) hard time limit ------------------------------------------------------------------------


def test_a_run_killed_at_its_hard_time_limit_gives_its_count_back(scenario):
    s = scenario(["q"])
    worker = capped_worker(s, 2)
    s.send("q", "killed", 5, time_limit=1)
    wait_for(lambda: s.labelled("start", "killed"), timeout=20, what="the time-limited task to start")
    started = time.monotonic()
    assert_settled(s, worker, "a run killed at its hard time limit")
    assert time.monotonic() - started < 4.5, "the count came back only when the sleep would have ended"
    assert "Hard time limit (1" in worker.log()
    # Both slots run new work: the killed child was replaced and its count is free.
    assert_full_capacity(s, worker, 2)
    assert not s.labelled("end", "killed")


# -- (h) unknown task name -------------------------------------------------------------------------


def test_an_unknown_task_name_gives_its_count_back(scenario):
    s = scenario(["q"])
    worker = capped_worker(s, 2)
    for i in range(3):
        s.send_task("q", "e2e.no-such-task", [f"unknown{i}"])
    wait_for(lambda: worker.log().count("Received unregistered task of type 'e2e.no-such-task'") >= 3,
             timeout=20, what="the worker to receive the 3 unknown tasks")
    assert_settled(s, worker, "three unknown tasks")
    assert s.broker_depth("q") == 0
    assert_full_capacity(s, worker, 2)


# -- (i) expired ----------------------------------------------------------------------------------


def test_an_expired_task_gives_its_count_back(scenario):
    s = scenario(["q"])
    worker = capped_worker(s, 2)
    past = (datetime.now(timezone.utc) - timedelta(minutes=1)).isoformat()
    # The expiry goes in the task header only: `expires=` in the past would
    # also set a zero AMQP TTL, and RabbitMQ would drop it before any worker.
    ids = [s.send("q", f"expired{i}", headers={"expires": past}) for i in range(3)]
    wait_for(lambda: all(f"Discarding revoked task: e2e.record[{i}]" in worker.log() for i in ids),
             timeout=20, what="the worker to discard the 3 expired tasks")
    assert_settled(s, worker, "three expired tasks")
    assert_full_capacity(s, worker, 2)
    assert not s.labelled("start", "expired")


# -- ETA that cannot be scheduled ---------------------------------------------------------------


def test_a_task_whose_eta_cannot_be_scheduled_is_rejected_and_gives_its_count_back(scenario):
    s = scenario(["q"])
    worker = capped_worker(s, 2)
    # A valid ISO date that overflows when the strategy converts it to the
    # system time zone: Celery has already sent task_received (the count is
    # bound to the request), then it rejects the message and returns —
    # no pool, no revoke.
    ids = [s.send("q", f"bad-eta{i}", headers={"eta": "9999-12-31T23:59:59-14:00"}) for i in range(2)]
    wait_for(lambda: worker.log().count("Couldn't convert ETA") >= 2, timeout=20,
             what="the worker to reject the 2 unschedulable ETA tasks")
    assert all(i in worker.log() for i in ids)
    assert_settled(s, worker, "two tasks whose ETA could not be scheduled")
    assert s.broker_depth("q") == 0
    assert_full_capacity(s, worker, 2)
    assert not s.labelled("start", "bad-eta")


# -- (j) inspect stats while running ---------------------------------------------------------------


def test_inspect_stats_show_what_is_held_while_it_runs(scenario):
    s = scenario(["a", "b"])
    a, b = s.by_name["a"], s.by_name["b"]
    for i in range(3):
        s.send_waiting("a", f"a{i}")
    for i in range(2):
        s.send_waiting("b", f"b{i}")
    worker = capped_worker(s, 3, durable_queue_concurrency={a: 2})
    wait_for(lambda: len(s.started()) >= 3, timeout=20, what="3 runs to start")
    stats = worker.wait_durable(lambda d: d["in_flight"] == 3, timeout=10, what="in_flight == 3")
    assert stats["max_in_flight"] == 3
    assert stats["capacity"] == 3
    assert stats["pool_size"] == 3
    # a is bound by its 2 slots, b gets the cap's last one.
    assert stats["held_by_queue"] == {a: 2, b: 1}
    assert stats["queue_slots"] == {a: 2, b: 8}
    assert len(s.started()) == 3
    assert s.broker_depth("a") == 1 and s.broker_depth("b") == 1
    s.open_gate("gate", 5)
    s.wait_ended(5, timeout=20)
    stats = assert_settled(s, worker, "five runs over two queues")
    assert stats["held_by_queue"] == {a: 0, b: 0}
    assert s.max_concurrency() == 3


def test_inspect_stats_of_an_uncapped_worker(scenario):
    s = scenario(["q"])
    q = s.by_name["q"]
    worker = s.worker(concurrency=2).wait_ready()
    for i in range(3):
        s.send_waiting("q", f"u{i}")
    wait_for(lambda: len(s.started()) >= 2, timeout=20, what="2 runs to start")
    stats = worker.wait_durable(lambda d: d["in_flight"] == 2, timeout=10, what="in_flight == 2")
    assert stats["max_in_flight"] is None
    assert stats["capacity"] == 2  # the pool bounds it
    assert stats["held_by_queue"] == {q: 2}
    assert stats["queue_slots"] == {q: 8}
    assert s.broker_depth("q") == 1
    s.open_gate("gate", 3)
    s.wait_ended(3, timeout=20)
    assert_settled(s, worker, "three runs on an uncapped worker")
    assert s.max_concurrency() == 2


# -- (k) Prometheus gauges --------------------------------------------------------------------------


def test_metrics_endpoint_shows_in_flight_and_capacity_during_a_run(scenario):
    s = scenario(["q"])
    port = free_port()
    worker = capped_worker(s, 2, durable_metrics_port=port)
    wait_for(lambda: scrape(port).get("job_worker_capacity") == 2.0, timeout=10,
             what="the metrics endpoint to serve capacity 2")
    assert scrape(port)["job_worker_in_flight"] == 0.0
    for i in range(3):
        s.send_waiting("q", f"m{i}")
    wait_for(lambda: len(s.started()) >= 2, timeout=20, what="2 runs to start")
    metrics = wait_for(lambda: (m := scrape(port)).get("job_worker_in_flight") == 2.0 and m,
                       timeout=10, what="job_worker_in_flight == 2")
    assert metrics["job_worker_capacity"] == 2.0
    s.open_gate("gate", 3)
    s.wait_ended(3, timeout=20)
    wait_for(lambda: scrape(port).get("job_worker_in_flight") == 0.0, timeout=SETTLE_SECONDS,
             what="job_worker_in_flight back to 0")
    assert scrape(port)["job_worker_capacity"] == 2.0
    assert_settled(s, worker, "a run with metrics served")
