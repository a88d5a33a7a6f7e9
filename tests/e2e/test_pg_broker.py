"""Real ``celery worker`` processes on the broker that claims rows, on PostgreSQL (``durable+postgresql://``) and
on SQLite (``durable+sqlite:///``): a stock prefork worker and a ``-P durable`` worker run tasks, and a
SIGKILLed worker's ``acks_late`` task runs on a second worker about one lease TTL later (the lease lapses; no
restart, no broker timer)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_durable.broker import register
from celery_durable.store.engine import ensure_schema
from tests.e2e.harness import Scenario, wait_for
from tests.e2e.test_fairness_and_cap import assert_strict_turns
from tests.stores import fresh_store

TTL = 3.0


def test_a_stock_prefork_worker_and_a_durable_worker_run_their_tasks(row_broker: Scenario) -> None:
    s = row_broker
    settings = {"durable_lease_ttl": TTL}
    stock = s.worker(pool="prefork", concurrency=2, queues=["a"], conf=settings).wait_ready()
    durable = s.worker(pool="durable", concurrency=2, queues=["b"], conf=settings).wait_ready()
    sent = [s.send("a", f"a{i}") for i in range(10)] + [s.send("b", f"b{i}") for i in range(10)]
    ended = s.wait_ended(20, timeout=60)
    assert sorted(e["id"] for e in ended) == sorted(sent)
    assert {e["queue"] for e in ended if e["label"].startswith("a")} == {s.by_name["a"]}
    assert {e["queue"] for e in ended if e["label"].startswith("b")} == {s.by_name["b"]}
    assert len(s.started()) == 20  # each ran once
    wait_for(lambda: s.broker_depth("a") == 0 and s.broker_depth("b") == 0, timeout=10,
             what="every row acked (deleted)")
    assert stock.terminate() == 0
    assert durable.terminate() == 0


@pytest.mark.parametrize("pool", ["prefork", "threads", "durable"])
def test_a_sigkilled_workers_acks_late_task_runs_on_another_within_a_lease_ttl(row_broker: Scenario,
                                                                                pool: str) -> None:
    s = row_broker
    settings = {"durable_lease_ttl": TTL, "task_acks_late": True}
    victim = s.worker(pool=pool, concurrency=1, queues=["a"], conf=settings).wait_ready()
    task_id = s.send_waiting("a", "held")
    wait_for(lambda: s.labelled("start", "held"), timeout=30, what="the victim to start the task")
    survivor = s.worker(pool=pool, concurrency=1, queues=["a"], conf=settings).wait_ready()
    time.sleep(TTL)  # past one TTL: the victim's heartbeat is what kept its row until now
    assert len(s.labelled("start", "held")) == 1, "a live holder's row was handed out"
    victim.kill()
    killed = time.time()
    again = wait_for(lambda: len(s.labelled("start", "held")) == 2, timeout=4 * TTL,
                     what="the killed worker's task to start again")
    assert again
    second = s.labelled("start", "held")[1]
    assert second["id"] == task_id
    assert second["t"] - killed <= TTL + 2.0, f"took {second['t'] - killed:.2f}s after the kill (TTL {TTL}s)"
    s.open_gate("gate")
    wait_for(lambda: s.labelled("end", "held"), timeout=30, what="the task to end on the survivor")
    wait_for(lambda: s.broker_depth("a") == 0, timeout=10, what="its row acked")
    assert survivor.terminate() == 0


def test_three_backlogged_queues_at_cap_one_run_in_strict_turns_on_a_durable_worker(row_broker: Scenario) -> None:
    s = row_broker
    for i in range(6):
        for name in ("a", "b", "c"):
            s.send(name, f"{name}{i}")
    worker = s.worker(conf={"durable_max_in_flight": 1, "durable_lease_ttl": TTL}, concurrency=1).wait_ready()
    assert_strict_turns(s, worker, "abc", rounds=6)


def test_three_backlogged_queues_among_fifty_run_in_strict_turns_at_cap_one(tmp_path: Path) -> None:
    # 47 empty queues around the three with work: each pass is one statement over all fifty.
    register()
    names = [f"q{i:02d}" for i in range(50)]
    busy = {"q07": "a", "q23": "b", "q41": "c"}
    with fresh_store("postgresql", tmp_path) as url:
        s = Scenario("durable", f"durable+{url}", names)
        try:
            for i in range(4):
                for name in busy:
                    s.send(name, f"{busy[name]}{i}")
            worker = s.worker(conf={"durable_max_in_flight": 1, "durable_lease_ttl": TTL},
                              concurrency=1).wait_ready()
            assert_strict_turns(s, worker, "abc", rounds=4)
        finally:
            s.cleanup()


@pytest.mark.parametrize("pool", ["durable", "prefork"])
def test_a_countdown_task_is_not_claimed_before_its_time_and_runs_after(row_broker: Scenario, pool: str) -> None:
    s = row_broker
    worker = s.worker(pool=pool, concurrency=2, queues=["a"], conf={"durable_lease_ttl": TTL}).wait_ready()
    engine = ensure_schema(s.broker_url.removeprefix("durable+"))
    sent = time.time()
    task_id = s.send("a", "later", countdown=3)
    # Until its time the row is no worker's: not claimed, not sitting in a worker's timer.
    while time.time() - sent < 2.7:
        with engine.connect() as conn:
            held = conn.execute(sa.text("SELECT count(*) FROM durable_broker_messages WHERE holder IS NOT NULL")
                                ).scalar()
        assert held == 0, f"claimed {time.time() - sent:.2f}s after a countdown of 3s"
        assert not s.labelled("start", "later")
        time.sleep(0.1)
    (ended,) = s.wait_ended(1, timeout=20)
    assert ended["id"] == task_id
    (started,) = s.labelled("start", "later")
    assert started["t"] - sent >= 2.9, f"started {started['t'] - sent:.2f}s after a countdown of 3s"
    assert worker.terminate() == 0


@pytest.mark.parametrize("pool", ["durable", "prefork"])
def test_a_row_whose_holders_all_died_is_parked_by_a_real_workers_claim_never_run(row_broker: Scenario,
                                                                                  pool: str) -> None:
    from celery_durable.broker import rows, sqlite_rows

    s = row_broker
    engine = ensure_schema(s.broker_url.removeprefix("durable+"))
    claim = sqlite_rows.claim if engine.dialect.name == "sqlite" else rows.claim
    queue = s.by_name["a"]
    task_id = s.send("a", "doomed")
    # e2e.record has Celery's default max_retries=3: four holders took the row and died (their leases
    # lapsed), as four SIGKILLed workers would leave it — each hand-out its own claim.
    for n in range(4):
        deadline = time.monotonic() + 10
        while not claim(engine, queue, 1, f"dead-{n}", 0.3):
            assert time.monotonic() < deadline, "the dead holder's lease never lapsed"
            time.sleep(0.05)
    time.sleep(0.4)
    s.send("a", "fine")
    worker = s.worker(pool=pool, concurrency=2, queues=["a"], conf={"durable_lease_ttl": TTL}).wait_ready()
    wait_for(lambda: s.labelled("end", "fine"), timeout=30, what="the other task to run")
    wait_for(lambda: "durable.broker.dead" in worker.log(), timeout=20, what="the burial to be logged")

    def rows_left() -> list[Any]:
        with engine.connect() as conn:
            return list(conn.execute(sa.text("SELECT queue, payload FROM durable_broker_messages")).all())

    # The other task's ack is batched: its row goes with the worker's next statement (a pass, the
    # heartbeat), a moment after the task ended.
    wait_for(lambda: [r.queue for r in rows_left()] == [queue + ".durable.parked"], timeout=10,
             what="only the parked row left (the other task's row acked)")
    parked = rows_left()
    assert task_id in parked[0].payload and "x-durable-parked-reason" in parked[0].payload
    assert not s.labelled("start", "doomed"), "a row whose holders all died was handed out as work"
    assert worker.terminate() == 0
