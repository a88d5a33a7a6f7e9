"""Fleet-wide limits on real ``-P durable`` workers (issue: fleet limits at claim time).

Each test runs real ``celery worker`` subprocesses on a real broker and a real
durable store; the tasks (tests/e2e/limitsapp.py) record their own starts and
ends in Redis, so the concurrency asserted is the one the runs saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_durable.store.engine import engine_for
from tests.conftest import DEFAULT_BROKER
from tests.e2e.durable_support import conf, durable_scenario  # noqa: F401 - durable_scenario is a fixture
from tests.e2e.harness import REPO, Scenario, WorkerProcess, wait_for
from tests.e2e.metrics_ports import free_port, metrics_text
from tests.services import broker_url

APP = "tests.e2e.limitsapp"


def running_peak(events: list[dict[str, Any]], killed_pids: set[int] = frozenset(), kill_index: int = -1) -> int:
    """Most runs running at once, from the starts and ends in the order Redis got them.

    A run whose process was SIGKILLed (its pid in ``killed_pids``, started before
    ``kill_index``) never records an end: it stops counting at the kill.
    """
    running: set[tuple[str, int]] = set()
    peak = 0
    for index, event in enumerate(events):
        if index == kill_index:
            running = {(run_id, pid) for run_id, pid in running if pid not in killed_pids}
        run = (event["id"], event["pid"])
        if event["e"] == "start":
            running.add(run)
        elif event["e"] == "end":
            running.discard(run)
        peak = max(peak, len(running))
    return peak


def _children(pid: int) -> set[int]:
    return {int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def _holder_of_a_running_export(s: Scenario, workers: list[WorkerProcess]) -> WorkerProcess | None:
    events = s.labelled("start", "x")
    ended = {e["id"] for e in s.labelled("end", "x")}
    running_pids = {e["pid"] for e in events if e["id"] not in ended}
    for worker in workers:
        if worker.process.poll() is None and _children(worker.process.pid) & running_pids:
            return worker
    return None


def _diagnose(s: Scenario, sent: set[str], url: str) -> str:
    missing = sent - {e["id"] for e in s.labelled("end", "x")}
    with engine_for(url).connect() as conn:
        parked = conn.execute(sa.text("SELECT task_id, publish_at FROM durable_limit_waiting")).all()
    unacked = ""
    if s.broker_kind == "redis":
        import redis

        held = redis.Redis.from_url(s.broker_url).hgetall("unacked")
        found = sum(1 for raw in held.values() if any(m.encode() in raw for m in missing))
        unacked = f"; in Redis's unacked hash {found}"
    logs = [w.log_path.name for w in s._workers if any(m in w.log() for m in missing)]
    return (f"missing {sorted(missing)[:5]} of {len(missing)}; started {len(missing & {e['id'] for e in s.started()})}"
            f"; leases {_leases(url)}; parked {parked[:5]}; broker depth {s.broker_depth('q')}{unacked}"
            f"; named in the logs of {logs}")


def _leases(url: str) -> list[dict[str, Any]]:
    with engine_for(url).connect() as conn:
        return [dict(r) for r in conn.execute(sa.text("SELECT * FROM durable_limit_leases")).mappings()]


# The limit's leases live in the store; the killed holder's messages come back by each transport's own
# recovery, proven per broker by the core files (test_killed_worker_recovery.py): a message broker and the
# rows broker here.
@pytest.mark.parametrize("broker_kind", ["redis", "postgresql"])
def test_durable_concurrency_holds_across_three_workers_and_a_killed_holder_is_reclaimed(
        durable_scenario, broker_kind):
    s, url = durable_scenario("postgresql", broker_kind)
    settings = conf(url, durable_lease_ttl=3, durable_restore_interval=0.3,
                    broker_transport_options={"visibility_timeout": 3})
    # Two prefork workers and one running its tasks on threads (leases given back from pool threads).
    workers = [s.worker(app=APP, conf={**settings, **extra}, queues=["q"], concurrency=4)
               for extra in ({}, {}, {"durable_execution": "threads"})]
    for worker in workers:
        worker.wait_ready()
    total = 200
    sent = {s.send_task("q", "limits.export", [f"x{i}", 0.05]) for i in range(total)}
    wait_for(lambda: len(s.labelled("end", "x")) >= 40, timeout=60, what="40 exports to end")

    # SIGKILL a worker while one of its processes runs an export (it holds a lease).
    victim = wait_for(lambda: _holder_of_a_running_export(s, workers), timeout=30,
                      what="a worker running an export", every=0.005)
    killed_pids = _children(victim.process.pid) | {victim.process.pid}
    victim.kill()
    kill_index = len(s.events())

    try:
        wait_for(lambda: {e["id"] for e in s.labelled("end", "x")} >= sent, timeout=120,
                 what="every export to end, the killed one's included")
    except AssertionError as err:
        raise AssertionError(f"{err}: {_diagnose(s, sent, url)}") from None
    events = [e for e in s.events() if e["label"].startswith("x")]
    assert running_peak(events, killed_pids, kill_index) == 3
    # The killed holder's lease expired and was reclaimed: nothing is held once all ended.
    wait_for(lambda: not _leases(url), timeout=10, what="every lease to be given back")


def busy_key_scenario(s: Scenario, url: str) -> tuple[list[float], int, list[Any]]:
    """Rule 3's scenario: 1,000 messages for org A (key limit 1) sent before 10 for org B, two workers.

    Returns B's start latencies (sorted, seconds from each send), how many of A's runs had ended when
    the last B started, and the workers. Shared with the soak, which holds B to the second.
    """
    workers = [s.worker(app=APP, conf=conf(url), queues=["q"], concurrency=4) for _ in range(2)]
    for worker in workers:
        worker.wait_ready()
    for i in range(1000):
        s.send_task("q", "limits.sync_plain", ["A", f"a{i}", 0.0])
    b_sent = {}
    for i in range(10):
        b_sent[s.send_task("q", "limits.sync_plain", ["B", f"b{i}", 0.0])] = time.time()
    # Polled gently: reading every event back is this process's work, on the workers' two cores; the
    # latency is read from the runs' own timestamps, not from when the poll saw them.
    wait_for(lambda: len(s.labelled("start", "b")) == 10, timeout=30, what="org B's 10 runs to start", every=0.25)
    b_starts = s.labelled("start", "b")
    last_b = max(e["t"] for e in b_starts)
    a_ended_before = sum(1 for e in s.labelled("end", "a") if e["t"] <= last_b)
    return sorted(e["t"] - b_sent[e["id"]] for e in b_starts), a_ended_before, workers


def test_workers_declaring_different_concurrency_apply_the_lowest_and_say_so(durable_scenario, monkeypatch):
    """A rolling deploy lowering durable_concurrency from 3 to 1: the new worker's 1 applies to the old
    ones too (it was 3 at once, the loosest), and each worker logs the mismatch once, naming both values."""
    s, url = durable_scenario("postgresql", "redis")
    monkeypatch.setenv("E2E_EXPORT_CONCURRENCY", "1")
    strict = s.worker(app=APP, conf=conf(url), queues=["q"], concurrency=3).wait_ready()
    monkeypatch.setenv("E2E_EXPORT_CONCURRENCY", "3")
    loose = [s.worker(app=APP, conf=conf(url), queues=["q"], concurrency=3).wait_ready() for _ in range(2)]
    sent = [s.send_task("q", "limits.export", [f"x{i}", 0.3]) for i in range(8)]
    wait_for(lambda: len(s.labelled("end", "x")) == len(sent), timeout=60, what="every export to end")
    assert running_peak([e for e in s.events() if e["label"].startswith("x")]) == 1, "the lowest declaration holds"
    for worker in loose + [strict]:
        wait_for(lambda worker=worker: "durable.limit.declarations_differ" in worker.log(), timeout=15,
                 what="each worker to log the differing declarations")
    for worker in loose + [strict]:
        lines = [line for line in worker.log().splitlines() if "durable.limit.declarations_differ" in line]
        assert len(lines) == 1, lines
        assert "task=limits.export option=durable_concurrency" in lines[0] and "applies" in lines[0]
    assert "this worker=3 another=1" in next(line for line in loose[0].log().splitlines()
                                               if "declarations_differ" in line)


@pytest.mark.parametrize("broker_kind", ["redis", "rabbitmq"])
def test_a_busy_key_does_not_hold_back_other_keys_on_the_same_queue(durable_scenario, broker_kind):
    """Rule 3: 1,000 messages for org A (limit 1) ahead of 10 for org B: B's runs start while A's wait —
    before a tenth of A's have run — and A never runs twice at once.

    How soon is a timing, read on a quiet machine by the soak (tests/soak/test_fleet_limits_soak.py:
    within a second); here, beside other tests on two cores, the property is what is held.
    """
    s, url = durable_scenario("postgresql", broker_kind)
    b_latency, a_ended_before, workers = busy_key_scenario(s, url)
    assert a_ended_before < 100, f"{a_ended_before} of A's runs ended before B's last start ({b_latency})"
    a_events = [e for e in s.events() if e["label"].startswith("a")]
    assert len(s.labelled("end", "a")) < 1000, "org A's runs must still be waiting their turn"
    assert running_peak(a_events) == 1
    assert running_peak([e for e in s.events() if e["label"].startswith("b")]) == 1
    # Waiting costs no churn: every A message was taken from the broker once (parked), not redelivered.
    stats = [w.durable_stats() for w in workers]
    assert s.broker_depth("q") < 1000
    print(f"\nrule 3 ({broker_kind}): org B's 10 runs started {b_latency[0] * 1000:.0f}-"
          f"{b_latency[-1] * 1000:.0f} ms after they were sent, behind 1,000 org A messages ({a_ended_before} "
          f"of A's had run); waited {sum(st['limits_waited'] for st in stats)}")


@pytest.mark.parametrize("broker_kind", ["redis", "rabbitmq", "postgresql"])
def test_wait_runs_every_message_once_in_arrival_order_and_burns_no_attempt(durable_scenario, broker_kind):
    """``when_busy="wait"``: each message runs once, per key in the order it arrived; a task with
    ``max_retries=0`` that waited behind 20 others still runs (retries stay 0)."""
    s, url = durable_scenario("postgresql", broker_kind)
    worker = s.worker(app=APP, conf=conf(url), queues=["q"], concurrency=4).wait_ready()
    sent = [s.send_task("q", "limits.sync_plain", [f"org{i % 2}", f"k{i}", 0.02]) for i in range(42)]
    durable = [s.send_task("q", "limits.sync_org", ["d", f"d{i}", 0.02]) for i in range(6)]
    wait_for(lambda: len(s.labelled("end", "k")) == 42 and len(s.labelled("end", "d")) == 6, timeout=60,
             what="every keyed run to end")
    starts = s.labelled("start", "k")
    assert sorted(e["id"] for e in starts) == sorted(sent), "each message runs exactly once"
    assert {e["retries"] for e in starts} == {0}, "waiting must not spend a retry"
    for org in ("org0", "org1"):
        order = [int(e["label"][1:]) for e in starts if int(e["label"][1:]) % 2 == int(org[-1])]
        assert order == sorted(order), f"{org} ran out of arrival order: {order}"
        assert running_peak([e for e in s.events() if e["label"].startswith("k")
                             and int(e["label"][1:]) % 2 == int(org[-1])]) == 1
    assert sorted(e["id"] for e in s.labelled("start", "d")) == sorted(durable)
    assert worker.durable_stats()["limits_waited"] >= 20
    assert "Retry in" not in worker.log()


@pytest.mark.parametrize("broker_kind", ["redis", "rabbitmq"])
def test_a_pass_parking_a_flood_gives_back_what_could_run_in_its_place(durable_scenario, broker_kind):
    """Rule 3's batches: a pass that parks a busy key's flood takes more than its slots; the messages
    of free keys it then has no slot for go back to the broker ahead of newer ones. Every message
    runs once, each org's two messages in arrival order, and org A's in theirs."""
    s, url = durable_scenario("postgresql", broker_kind)
    # The backlog is all there before the worker starts: a worker that keeps up with the sends would
    # take them one at a time (nothing to batch), as it should.
    sent = {s.send_task("q", "limits.sync_plain", ["A", "a000", 1.0]): "a000"}  # holds org A's key a while
    for i in range(1, 101):
        sent[s.send_task("q", "limits.sync_plain", ["A", f"a{i:03}", 0.0])] = f"a{i:03}"
    for i in range(20):
        sent[s.send_task("q", "limits.sync_plain", [f"o{i}", f"o{i:02}-1", 0.05])] = f"o{i:02}-1"
    for i in range(20):
        sent[s.send_task("q", "limits.sync_plain", [f"o{i}", f"o{i:02}-2", 0.0])] = f"o{i:02}-2"
    worker = s.worker(app=APP, conf=conf(url), queues=["q"], concurrency=2).wait_ready()

    wait_for(lambda: len(s.ended()) == len(sent), timeout=90, what="every run to end", every=0.25)
    starts = s.started()
    assert sorted(e["id"] for e in starts) == sorted(sent), "each message runs exactly once"
    order = {e["label"]: index for index, e in enumerate(starts)}
    assert [e["label"] for e in starts if e["label"].startswith("a")] == [f"a{i:03}" for i in range(101)]
    for i in range(20):
        assert order[f"o{i:02}-1"] < order[f"o{i:02}-2"], f"org o{i}'s second message ran before its first"
    stats = worker.durable_stats()
    assert stats["limits_waited"] >= 100
    # Only a pass that took more than its slots can have a message to give back.
    assert stats["claims_handed_back"] > 0, f"no pass took more than its slots: {stats}"


def test_drop_drops_only_while_the_key_is_busy(durable_scenario):
    # A drop acks the claimed message like any settled run: nothing in it is the transport's own.
    s, url = durable_scenario("postgresql", DEFAULT_BROKER)
    worker = s.worker(app=APP, conf=conf(url), queues=["q"], concurrency=4).wait_ready()
    first = s.send_task("q", "limits.debounce", ["o1", "first", 1.5])
    wait_for(lambda: s.labelled("start", "first"), timeout=10, what="the first run to start")
    for i in range(5):
        s.send_task("q", "limits.debounce", ["o1", f"busy{i}", 0.0])
    other = s.send_task("q", "limits.debounce", ["o2", "other", 0.0])
    wait_for(lambda: worker.durable_stats()["limits_dropped"] == 5, timeout=10, what="5 dropped messages")
    wait_for(lambda: s.labelled("end", "first"), timeout=10, what="the first run to end")
    # The "end" event is the task body's last line: the run still holds its key until it has returned
    # and its count goes back. A message claimed in between is busy and dropped, rightly, and "after"
    # never ran (1 failure in a loaded suite run). The key is free once its lease has left the store.
    wait_for(lambda: not [lease for lease in _leases(url) if lease["key"] == "org:o1"], timeout=10,
             what="the first run's lease to go back")
    after = s.send_task("q", "limits.debounce", ["o1", "after", 0.0])
    wait_for(lambda: s.labelled("end", "after"), timeout=10, what="a run after the key freed")
    assert {e["id"] for e in s.started()} == {first, other, after}, "only the messages sent while busy drop"
    assert worker.durable_stats()["limits_dropped"] == 5
    assert worker.log().count("durable.limit.dropped") == 5


def test_a_key_function_that_raises_fails_that_run_naming_the_error(durable_scenario):
    s, url = durable_scenario("postgresql", "redis")
    worker = s.worker(app=APP, conf=conf(url), queues=["q"], concurrency=2).wait_ready()
    bad = s.send_task("q", "limits.fragile_key", ["boom", "bad"])
    good = s.send_task("q", "limits.fragile_key", ["fine", "good"])
    wait_for(lambda: s.labelled("end", "good"), timeout=10, what="the run with a good key to end")
    wait_for(lambda: "durable.limit.key_failed" in worker.log(), timeout=10, what="the failed key to be logged")
    assert [e["id"] for e in s.started()] == [good]
    line = next(line for line in worker.log().splitlines() if "durable.limit.key_failed" in line)
    assert bad in line and "durable_key raised ValueError('no org named boom')" in line
    assert s.broker_depth("q") == 0, "the failed run's message is settled, not left to come back"


@pytest.mark.parametrize("where", ["function", "header"])
def test_a_key_the_store_cannot_hold_fails_that_run_and_the_rest_of_its_pass_runs(durable_scenario, where):
    """A key with a NUL made the claim pass's store transaction fail, every pass: it read as a store
    outage, the message was never settled, and the limited messages decided beside it went back with it."""
    s, url = durable_scenario("postgresql", "redis")
    if where == "function":
        bad = s.send_task("q", "limits.sync_plain", ["o\x00rg", "bad", 0.0])
    else:
        bad = s.send_task("q", "limits.sync_plain", ["o0", "bad", 0.0], headers={"durable_key": "org:\x00"})
    good = [s.send_task("q", "limits.sync_plain", [f"o{i + 1}", f"good{i}", 0.0]) for i in range(5)]
    # Sent before the worker starts, so the bad message and the good ones meet in one claim pass.
    worker = s.worker(app=APP, conf=conf(url), queues=["q"], concurrency=4).wait_ready()
    wait_for(lambda: len(s.labelled("end", "good")) == 5, timeout=15,
             what="the 5 good runs to end")
    wait_for(lambda: "durable.limit.key_failed" in worker.log(), timeout=10, what="the bad key to be logged")
    assert {e["id"] for e in s.started()} == set(good)
    line = next(line for line in worker.log().splitlines() if "durable.limit.key_failed" in line)
    assert bad in line and "NUL" in line
    assert "durable.limit.store_unavailable" not in worker.log(), "a bad key is not a store outage"
    wait_for(lambda: s.broker_depth("q") == 0, timeout=10, what="the bad run's message to be settled")


@pytest.mark.parametrize(("store_kind", "workers_count"), [("postgresql", 3), ("sqlite", 1)])
def test_a_fleet_rate_limit_spreads_starts_evenly_across_workers(durable_scenario, monkeypatch, store_kind,
                                                                 workers_count):
    """Rule 5 at six times the rate (600/m for 10 s in place of 100/m for 60 s; the soak runs the latter):
    100 ± 2 starts in the window, one every 100 ms at the median, no second holding more than one and a half
    seconds' worth (the first second's are late: republished turns queue behind the flood still being gated)."""
    s, url = durable_scenario(store_kind, "redis")
    monkeypatch.setenv("E2E_RATE", "600/m")
    workers = [s.worker(app=APP, conf=conf(url), queues=["q"], concurrency=4) for _ in range(workers_count)]
    for worker in workers:
        worker.wait_ready()
    for i in range(180):
        s.send_task("q", "limits.partner", [f"r{i}"])
    wait_for(lambda: len(s.labelled("start", "r")) >= 115, timeout=60, what="115 rate-limited runs to start")
    starts = sorted(e["t"] for e in s.labelled("start", "r"))
    window = [t for t in starts if t < starts[0] + 10.0]
    assert 98 <= len(window) <= 102, [round(t - starts[0], 3) for t in starts[:40]]
    per_second: dict[int, int] = {}
    for t in window:
        per_second[int(t - starts[0])] = per_second.get(int(t - starts[0]), 0) + 1
    assert max(per_second.values()) <= 15, sorted(per_second.items())
    gaps = sorted(b - a for a, b in zip(window, window[1:]))
    assert 0.08 <= gaps[len(gaps) // 2] <= 0.12, gaps
    print(f"\nrate 600/m on {store_kind} x{workers_count}: {len(window)} starts in 10 s, gap p50 "
          f"{gaps[len(gaps) // 2] * 1000:.0f} ms, max {gaps[-1] * 1000:.0f} ms")


NAN = float("nan")
BAD_LIMITS = [
    pytest.param({"durable_concurrency": 0}, "durable_concurrency", "got 0", id="concurrency-0"),
    pytest.param({"durable_concurrency": -3}, "durable_concurrency", "got -3", id="concurrency-negative"),
    pytest.param({"durable_concurrency": 2.5}, "durable_concurrency", "got 2.5", id="concurrency-fraction"),
    pytest.param({"durable_concurrency": NAN}, "durable_concurrency", "got nan", id="concurrency-nan"),
    pytest.param({"durable_key": True, "durable_key_limit": 0}, "durable_key_limit", "got 0", id="key-limit-0"),
    pytest.param({"durable_key": True, "durable_when_busy": "later"}, "durable_when_busy", "'later'",
                 id="when-busy-unknown"),
    pytest.param({"durable_rate_limit": "100/x"}, "durable_rate_limit", "got '100/x'", id="rate-100/x"),
    pytest.param({"durable_rate_limit": "0/m"}, "durable_rate_limit", "got '0/m'", id="rate-0"),
    # Past PostgreSQL's integer: booted, then every claim of the task failed in the store (issue 22 item 2).
    pytest.param({"durable_concurrency": 2**63 - 1}, "durable_concurrency", "at most 2147483647",
                 id="concurrency-maxsize"),
    pytest.param({"durable_key": True, "durable_key_limit": 2**31}, "durable_key_limit", "at most 2147483647",
                 id="key-limit-2**31"),
    pytest.param({"durable_rate_limit": "2147483648/s"}, "durable_rate_limit", "at most 2147483647",
                 id="rate-count-2**31"),
    # A typo booted with no limit and no word (issue 22 item 3).
    pytest.param({"durable_concurency": 2}, "durable_concurency", "did you mean durable_concurrency?",
                 id="option-typo"),
]


def _assert_refused_in_one_line(worker: WorkerProcess, *needles: str) -> None:
    wait_for(lambda: worker.process.poll() is not None, timeout=60, what="the worker to refuse and exit",
             every=0.05)
    log = worker.log()
    assert worker.process.returncode > 0, log[-3000:]
    lines = [line for line in log.splitlines() if "refusing to start" in line or "durable.config.invalid" in line
             or "durable.limit.unenforced" in line]
    assert lines and all(needle in lines[0] for needle in needles), log[-3000:]
    assert "Traceback" not in log and " ready." not in log, log[-3000:]


@pytest.mark.parametrize(("options", "option", "problem"), BAD_LIMITS)
def test_a_bad_limit_value_refuses_the_boot_naming_the_task_and_option(durable_scenario, monkeypatch, options,
                                                                       option, problem):
    s, url = durable_scenario("sqlite", "redis")
    monkeypatch.setenv("E2E_LIMIT_OPTIONS", json.dumps(options))
    worker = s.worker(app="tests.e2e.limitsbadapp", conf=conf(url), queues=["q"])
    _assert_refused_in_one_line(worker, "'limits.bad'", option, problem)


def test_a_limited_task_on_a_worker_that_cannot_reach_its_store_is_refused(durable_scenario):
    s, _ = durable_scenario("sqlite", "redis")
    worker = s.worker(app=APP, conf=conf("postgresql://nobody@127.0.0.1:1/none"), queues=["q"])
    _assert_refused_in_one_line(worker, "limits.", "needs the durable store", "127.0.0.1:1")


def test_a_limited_task_on_a_stock_pool_is_refused_rather_than_run_unchecked(durable_scenario):
    s, url = durable_scenario("sqlite", "redis")
    s.send_task("q", "limits.export", ["never", 0.0])
    worker = s.worker(app=APP, conf=conf(url), queues=["q"], pool="prefork")
    _assert_refused_in_one_line(worker, "limits.", "only a -P durable worker enforces", "-P prefork")
    assert s.started() == [] and s.broker_depth("q") == 1


def test_a_countdown_run_takes_its_lease_when_due_and_waits_if_the_limit_is_held(durable_scenario):
    """An ETA message holds no lease while it waits for its time; when due it meets the limit like any other."""
    s, url = durable_scenario("postgresql", "redis")
    worker = s.worker(app=APP, conf=conf(url), queues=["q"], concurrency=4).wait_ready()
    s.send_task("q", "limits.gated", ["holder"])
    wait_for(lambda: s.labelled("start", "holder"), timeout=10, what="the holder to start")
    s.send_task("q", "limits.gated", ["later"], countdown=1)
    # Due while the holder runs: it goes to wait in the store, holding no slot.
    wait_for(lambda: worker.durable_stats()["limits_waited"] == 1, timeout=10, what="the due run to wait")
    assert worker.durable_stats()["in_flight"] == 1
    assert not s.labelled("start", "later")
    s.open_gate(count=2)
    wait_for(lambda: s.labelled("end", "later"), timeout=10, what="the countdown run to run after the holder")
    assert running_peak([e for e in s.events()]) == 1


def _limits_command(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "E2E_BROKER": broker_url("redis"),
           "E2E_CONF": json.dumps(conf(url))}
    return subprocess.run([sys.executable, "-m", "celery", "-A", APP, "durable", "limits", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_held_and_waiting_show_in_stats_gauges_and_the_limits_command(durable_scenario):
    s, url = durable_scenario("postgresql", "redis")
    port = free_port()
    worker = s.worker(app=APP, conf=conf(url, durable_metrics_port=port), queues=["q"], concurrency=4)
    worker.wait_ready()
    holder = s.send_task("q", "limits.gated", ["holder"])
    for i in range(2):
        s.send_task("q", "limits.gated", [f"w{i}"])
    wait_for(lambda: worker.durable_stats()["limits_waited"] == 2, timeout=10, what="two runs waiting")
    assert worker.durable_stats()["leases"] == {"limits.gated": {"*": 1}}
    text = metrics_text(port)
    assert 'durable_limit_in_use{task="limits.gated"} 1.0' in text, text
    assert 'durable_limit_waiting{task="limits.gated"} 2.0' in text, text
    assert 'durable_limit_in_use{task="limits.export"} 0.0' in text, "a declared limit shows even when idle"
    shown = _limits_command(url)
    assert shown.returncode == 0, shown.stderr
    assert "limits.gated: concurrency=1, when busy: wait; 1 held, 2 waiting" in shown.stdout, shown.stdout
    assert holder in shown.stdout
    report = {entry["task"]: entry for entry in json.loads(_limits_command(url, "--json").stdout)}
    assert report["limits.partner"]["rate"] == "100/60s" and report["limits.gated"]["waiting"] == 2
    s.open_gate(count=3)
    wait_for(lambda: len(s.labelled("end", "")) == 3, timeout=10, what="all three to run")
    wait_for(lambda: 'durable_limit_in_use{task="limits.gated"} 0.0' in metrics_text(port), timeout=5,
             what="the gauge to read 0 once all ran")


def test_a_call_may_name_its_key_in_a_header(durable_scenario):
    """``apply_async(headers={"durable_key": ...})`` replaces the key function's key for that message."""
    s, url = durable_scenario("postgresql", "redis")
    worker = s.worker(app=APP, conf=conf(url), queues=["q"], concurrency=4).wait_ready()
    first = s.send_task("q", "limits.debounce", ["o1", "first", 1.0])
    wait_for(lambda: s.labelled("start", "first"), timeout=10, what="the first run to start")
    same_key = s.send_task("q", "limits.debounce", ["o2", "same", 0.0], headers={"durable_key": "org:o1"})
    other_key = s.send_task("q", "limits.debounce", ["o1", "other", 0.0], headers={"durable_key": "org:zz"})
    wait_for(lambda: s.labelled("end", "other"), timeout=10, what="the run with another key to run")
    wait_for(lambda: worker.durable_stats()["limits_dropped"] == 1, timeout=10, what="the same key to drop")
    assert {e["id"] for e in s.started()} == {first, other_key}
    assert same_key not in {e["id"] for e in s.started()}


def test_a_call_may_say_what_it_does_when_busy_in_a_header(durable_scenario):
    """``headers={"durable_when_busy": "drop"}`` drops that call of a task that waits when busy; a header
    that is not a choice fails that run, named, and the task's other calls wait as declared."""
    s, url = durable_scenario("postgresql", "redis")
    worker = s.worker(app=APP, conf=conf(url), queues=["q"], concurrency=4).wait_ready()
    first = s.send_task("q", "limits.sync_plain", ["o1", "first", 1.0])
    wait_for(lambda: s.labelled("start", "first"), timeout=10, what="the first run to start")
    dropped = s.send_task("q", "limits.sync_plain", ["o1", "dropped", 0.0], headers={"durable_when_busy": "drop"})
    bad = s.send_task("q", "limits.sync_plain", ["o1", "bad", 0.0], headers={"durable_when_busy": "later"})
    waits = s.send_task("q", "limits.sync_plain", ["o1", "waits", 0.0])
    wait_for(lambda: s.labelled("end", "waits"), timeout=15, what="the waiting call to run after the first")
    assert [e["id"] for e in s.started()] == [first, waits]
    assert worker.durable_stats()["limits_dropped"] == 1 and dropped not in {e["id"] for e in s.started()}
    line = next(line for line in worker.log().splitlines() if "durable.limit.key_failed" in line)
    assert bad in line and "header durable_when_busy must be one of ('wait', 'drop'), got 'later'" in line


def test_a_store_outage_keeps_limited_messages_in_the_broker_and_plain_tasks_running(durable_scenario, fault_proxy):
    """The store cannot say whether a limited run fits: its message goes back to the broker (no run, no
    retry spent), claiming pauses a second at a time, unlimited tasks keep running; once the store is
    back every limited run runs, under its limit."""
    s, url = durable_scenario("postgresql", "redis")
    proxy = fault_proxy(url)
    worker = s.worker(app=APP, conf=conf(proxy.url_for(url), durable_lease_ttl=2), queues=["q"],
                      concurrency=4).wait_ready()
    proxy.outage()
    exports = {s.send_task("q", "limits.export", [f"x{i}", 0.05]) for i in range(6)}
    plain = {s.send_task("q", "e2e.record", [f"p{i}", 0.0]) for i in range(3)}
    wait_for(lambda: {e["id"] for e in s.labelled("end", "p")} == plain, timeout=30,
             what="the unlimited tasks to run during the outage")
    wait_for(lambda: "durable.store.unavailable" in worker.log(), timeout=10, what="the outage reported")
    assert not s.labelled("start", "x"), "a limited run started while the store could not count it"
    # Between two tries (a second apart) every limited message is back in the broker.
    wait_for(lambda: s.broker_depth("q") == 6, timeout=10, what="the limited messages to be in the broker")
    proxy.restore()
    wait_for(lambda: {e["id"] for e in s.labelled("end", "x")} == exports, timeout=30,
             what="every limited run once the store is back")
    assert running_peak([e for e in s.events() if e["label"].startswith("x")]) <= 3
    assert {e["retries"] for e in s.labelled("start", "x")} == {0}
    assert worker.process.poll() is None
