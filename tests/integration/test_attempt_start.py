"""Starting an attempt with its checkpoints (``attempts.start``), on PostgreSQL and SQLite: what it finds, what it
loads, how many statements it sends, and (PostgreSQL) that a takeover still sees a checkpoint in flight."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection

from celery_durable.planning.checkpoints import StepKey
from celery_durable.store import attempts, runs, steps
from celery_durable.store.clock import store_now
from celery_durable.store.engine import autocommit, ensure_schema
from tests.e2e.harness import wait_for


@pytest.fixture
def conn(store_url: str) -> Iterator[Connection]:
    with autocommit(ensure_schema(store_url)).connect() as c:
        yield c


def start(conn: Connection, token: str, *, ttl: float = 30.0, resume: str | None = None,
          retries: int = 0) -> attempts.Start:
    return attempts.start(conn, run_id="r1", task_name="t", queue="q", args="[]", kwargs="{}", token=token,
                          lease_seconds=ttl, resume=resume, retries=retries)


@contextmanager
def statements(conn: Connection) -> Iterator[list[str]]:
    sent: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "clock_timestamp" not in statement:  # the store's clock, read once per 10 s whatever runs
            sent.append(statement)

    event.listen(conn.engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        event.remove(conn.engine, "before_cursor_execute", record)


def expire(conn: Connection) -> None:
    wait_for(lambda: not runs.get(conn, "r1").lease_live(store_now(conn)), timeout=5, what="the lease to expire")


def test_a_new_run_starts_with_no_checkpoints_in_one_statement(conn):
    with statements(conn) as sent:
        found = start(conn, "a1")
    assert found.started and found.checkpoints == {}
    assert (found.run.id, found.run.lease_holder, found.run.attempts, found.run.state) == ("r1", "a1", 1, "running")
    assert len(sent) == 1


@pytest.mark.parametrize("retries, one_message", [(1, True), (0, False)])
def test_a_takeover_loads_the_checkpoints_of_the_attempt_it_replaces(conn, retries, one_message):
    start(conn, "a1", ttl=0.2)
    assert steps.insert(conn, "r1", StepKey("charge", 0), '"ch-1"', "a1")
    assert steps.insert(conn, "r1", StepKey("charge", 1), '"ch-2"', "a1")
    expire(conn)
    with statements(conn) as sent:
        found = start(conn, "a2", retries=retries)
    assert found.started and (found.run.lease_holder, found.run.attempts, found.run.lost_attempts) == ("a2", 2, 1)
    assert found.checkpoints == {StepKey("charge", 0): '"ch-1"', StepKey("charge", 1): '"ch-2"'}
    # PostgreSQL: a retry's start and read travel as one message; a delivery that looks new reads in a
    # second round trip once it turns out not to be; SQLite runs them one by one, in-process.
    assert len(sent) == (1 if conn.dialect.name == "postgresql" and one_message else 2)


def test_a_live_or_settled_run_comes_back_as_found_without_its_checkpoints(conn):
    first = start(conn, "a1")
    assert steps.insert(conn, "r1", StepKey("charge", 0), '"ch-1"', "a1")
    live = start(conn, "a2", retries=1)
    assert not live.started and live.checkpoints == {}
    assert (live.run.lease_holder, live.run.attempts) == ("a1", 1)
    assert runs.settle(conn, first.run, "succeeded", result="1") is not None
    settled = start(conn, "a3", retries=1)
    assert not settled.started and settled.checkpoints == {}
    assert (settled.run.state, settled.run.result, settled.run.settled_by) == ("succeeded", "1", "a1")


def test_the_hand_off_token_resumes_a_sleeping_run_with_its_checkpoints(conn):
    start(conn, "a1")
    assert steps.insert(conn, "r1", StepKey("nap", 0), "1.5", "a1")
    assert runs.hand_off_to_sleep(conn, "r1", "a1")
    assert not start(conn, "other").started
    woke = start(conn, "a2", resume="a1")
    assert woke.started and woke.run.lost_attempts == 0 and woke.checkpoints == {StepKey("nap", 0): "1.5"}


# PostgreSQL only (SQLite has one writer at a time: a takeover cannot run beside an open write transaction).
@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_a_one_round_trip_takeover_waits_for_a_checkpoint_in_flight_then_loads_it(store_url, conn):
    """The start and the read share a message, not a snapshot: the read still sees the checkpoint the
    start waited for (one statement with a CTE would not)."""
    start(conn, "a1", ttl=0.2)
    expire(conn)
    engine = ensure_schema(store_url)
    taker = autocommit(engine).connect()
    taker_pid = taker.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    taken: list[attempts.Start] = []
    thread = threading.Thread(target=lambda: taken.append(start(taker, "a2", retries=1)))
    with engine.connect() as checkpointing:
        tx = checkpointing.begin()
        assert steps.insert(checkpointing, "r1", StepKey("ledger", 0), '"ledger"', "a1")
        thread.start()
        try:
            wait_for(lambda: conn.execute(sa.text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :p"),
                                          {"p": taker_pid}).scalar() == "Lock",
                     timeout=5, what="the takeover to wait on the lock of the checkpoint in flight")
            assert taken == []
        finally:
            tx.commit()
            thread.join(10)
            taker.close()
    [found] = taken
    assert found.started and found.run.lease_holder == "a2"
    assert found.checkpoints == {StepKey("ledger", 0): '"ledger"'}


def synchronous_commit(conn: Connection) -> str:
    return str(conn.exec_driver_sql("SHOW synchronous_commit").scalar_one())


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("retries", [0, 1], ids=["new run, start alone", "retry, start and read"])
def test_a_start_commits_without_waiting_for_the_flush_and_the_steps_after_it_still_wait(store_url, conn, retries):
    """The start's message turns the flush wait off for its own transaction only: the checkpoint and the
    settle sent next on the same connection wait for theirs (their flush makes the start durable too)."""
    with statements(conn) as sent:
        found = start(conn, "a1", retries=retries)
        assert steps.insert(conn, "r1", StepKey("charge", 0), '"ch-1"', "a1")
        assert runs.settle(conn, found.run, "succeeded", result='"done"') is not None
    assert found.started
    assert sent[0].startswith("SET LOCAL synchronous_commit TO off; INSERT INTO durable_runs"), sent[0]
    assert [s for s in sent[1:] if "synchronous_commit" in s] == [], sent[1:]
    assert synchronous_commit(conn) == "on"


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_a_start_in_a_callers_transaction_leaves_that_transactions_flush_wait_alone(store_url):
    """Outside autocommit, SET LOCAL would turn the wait off for the rest of the caller's transaction."""
    with ensure_schema(store_url).connect() as tx:
        run, started = runs.begin_attempt(tx, run_id="r1", task_name="t", queue="q", args="[]", kwargs="{}",
                                          token="a1", lease_seconds=30.0)
        assert started and run.lease_holder == "a1"
        assert synchronous_commit(tx) == "on"
        tx.rollback()
