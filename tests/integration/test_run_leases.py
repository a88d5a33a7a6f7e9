"""Run leases on a real store (PostgreSQL and SQLite): one live attempt per run, takeover, hand-off, fencing."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_durable.leases.keeper import LeaseKeeper
from celery_durable.planning.checkpoints import StepKey
from celery_durable.store import runs, steps
from celery_durable.store.clock import store_now
from celery_durable.store.engine import autocommit, ensure_schema
from tests.e2e.harness import wait_for


@pytest.fixture
def conn(store_url: str):
    with autocommit(ensure_schema(store_url)).connect() as c:
        yield c


def begin(conn: Connection, token: str, *, ttl: float = 30.0, resume: str | None = None,
          run_id: str = "r1", retries: int = 0) -> tuple[runs.Run, bool]:
    return runs.begin_attempt(conn, run_id=run_id, task_name="t", queue="q", args="[]", kwargs="{}",
                              token=token, lease_seconds=ttl, resume=resume, retries=retries)


def test_a_second_delivery_of_a_live_run_does_not_start(conn):
    first, started = begin(conn, "a1")
    assert started and first.lease_holder == "a1" and first.lease_live(store_now(conn))
    found, started = begin(conn, "a2")
    assert not started
    assert (found.lease_holder, found.attempts, found.state) == ("a1", 1, "running")


def test_an_expired_lease_is_taken_over_and_counted_as_a_lost_attempt(conn):
    begin(conn, "a1", ttl=0.2)
    wait_for(lambda: not runs.get(conn, "r1").lease_live(store_now(conn)), timeout=5, what="the lease to expire")
    taken, started = begin(conn, "a2")
    assert started
    assert (taken.lease_holder, taken.attempts, taken.lost_attempts) == ("a2", 2, 1)


def test_the_message_a_run_was_handed_to_resumes_it_at_once_and_loses_nothing(conn):
    begin(conn, "a1")
    # A store outage re-sent the run under a1's own token: no need to wait for the expiry.
    resumed, started = begin(conn, "a2", resume="a1")
    assert started and (resumed.lease_holder, resumed.lost_attempts) == ("a2", 0)
    # A stale copy carrying the old token finds a2 live.
    _, started = begin(conn, "a3", resume="a1")
    assert not started


def test_a_sleeping_run_is_resumed_only_by_its_wake_up(conn):
    begin(conn, "a1")
    assert runs.hand_off_to_sleep(conn, "r1", "a1")
    sleeping = runs.get(conn, "r1")
    assert (sleeping.state, sleeping.lease_holder, sleeping.lease_live(store_now(conn))) == ("sleeping", "a1", False)
    _, started = begin(conn, "copy")  # a redelivered copy, no token
    assert not started
    woken, started = begin(conn, "a2", resume="a1")
    assert started and (woken.state, woken.lost_attempts) == ("running", 0)


def test_an_outcome_is_written_only_by_the_attempt_holding_the_run(conn):
    old, _ = begin(conn, "a1", ttl=0.2)
    wait_for(lambda: not runs.get(conn, "r1").lease_live(store_now(conn)), timeout=5, what="the lease to expire")
    new, _ = begin(conn, "a2")
    # The old attempt (its store was out longer than the TTL) finishes late: refused.
    assert runs.settle(conn, old, "succeeded", result="1") is None
    settled = runs.settle(conn, new, "succeeded", result="2")
    assert settled is not None and (settled.result, settled.lease_holder) == ("2", None)
    assert runs.get(conn, "r1").lease_holder is None


def test_renew_pushes_out_only_the_leases_still_held(conn):
    begin(conn, "a1", run_id="r1", ttl=1.0)
    begin(conn, "b1", run_id="r2", ttl=1.0)
    renewed = runs.renew(conn, {"r1": "a1", "r2": "not-mine", "r3": "gone"}, 30.0)
    assert renewed == {"r1"}
    assert (runs.get(conn, "r1").lease_expires_at > runs.get(conn, "r2").lease_expires_at)


def test_reopen_takes_a_dead_run_or_a_stranded_one_but_never_a_live_one(conn):
    begin(conn, "a1", ttl=0.2)
    assert not runs.reopen(conn, "r1", store_now(conn) - runs.timedelta(seconds=5))  # still live then
    wait_for(lambda: not runs.get(conn, "r1").lease_live(store_now(conn)), timeout=5, what="the lease to expire")
    assert runs.reopen(conn, "r1", store_now(conn))
    reopened = runs.get(conn, "r1")
    assert (reopened.state, reopened.lease_holder, reopened.lost_attempts) == ("failed", None, 0)


def test_the_keeper_renews_a_held_lease_past_its_ttl_and_stops_on_release(store_url, conn):
    begin(conn, "k1", ttl=0.6)
    keeper = LeaseKeeper()
    keeper.hold(store_url, "r1", "k1", 0.6)
    deadline = time.monotonic() + 2.0
    # Three TTLs later the lease is still live: the keeper beat every 0.2 s.
    while time.monotonic() < deadline:
        assert runs.get(conn, "r1").lease_live(store_now(conn))
        time.sleep(0.05)
    keeper.release(store_url, "r1")
    wait_for(lambda: not runs.get(conn, "r1").lease_live(store_now(conn)), timeout=5,
             what="the lease to expire once released")


def test_the_keeper_says_lost_only_when_another_attempt_holds_the_run(store_url, conn, caplog):
    begin(conn, "k1", run_id="settled", ttl=0.3)
    taken, _ = begin(conn, "k1", run_id="taken", ttl=0.3)
    keeper = LeaseKeeper()
    keeper.hold(store_url, "settled", "k1", 0.3)
    keeper.hold(store_url, "taken", "k1", 0.3)
    # One attempt settles (and has not released its lease yet); the other run is taken over.
    settled_run = runs.get(conn, "settled")
    assert runs.settle(conn, settled_run, "succeeded", result="1") is not None
    conn.execute(runs.runs.update().where(runs.runs.c.id == "taken").values(lease_holder="k2"))

    def lost() -> list[str]:
        return [r.getMessage() for r in caplog.records if "durable.lease.lost" in r.getMessage()]

    # Waited for on the warning, the keeper's last act: it drops the run from its list first, then logs
    # (outside its lock), so a wait on the list alone once read the log before the warning was in it.
    with caplog.at_level("WARNING", logger="celery_durable.run"):
        wait_for(lost, timeout=5, what="the keeper to report the lost lease")
    assert len(lost()) == 1 and "taken" in lost()[0]
    assert "taken" not in keeper.held().get(store_url, {})
    assert "settled" in keeper.held()[store_url]  # still listed until its attempt releases it
    keeper.release(store_url, "settled")


def test_a_stranded_run_is_handed_to_one_token_that_every_later_copy_keeps(conn):
    """The recovery sweep's hand-off (tasks/recovery.py): the lapsed lease's run gets a new token and one
    lost attempt; sending it again later keeps that token (a copy queued behind a backlog still resumes
    it) and counts nothing more; the copy carrying it takes the run at once."""
    from datetime import timedelta

    begin(conn, "dead", ttl=0.2, retries=2)
    wait_for(lambda: not runs.get(conn, "r1").lease_live(store_now(conn)), timeout=5, what="the lease to lapse")
    now = store_now(conn)
    [stranded] = runs.stranded(conn, now, now - timedelta(seconds=60), 10)
    assert (stranded.retries, stranded.lease_holder) == (2, "dead")
    token = runs.hand_off_to_resend(conn, stranded, "sweep-1", now)
    assert token == "sweep-1"
    handed = runs.get(conn, "r1")
    assert (handed.lease_holder, handed.lease_expires_at, handed.lost_attempts) == ("sweep-1", None, 1)
    # Not again until the resend bound, and then under the same token.
    assert runs.stranded(conn, store_now(conn), store_now(conn) - timedelta(seconds=60), 10) == []
    [again] = runs.stranded(conn, store_now(conn), store_now(conn) + timedelta(seconds=1), 10)
    assert runs.hand_off_to_resend(conn, again, "sweep-2", store_now(conn)) == "sweep-1"
    assert runs.get(conn, "r1").lost_attempts == 1
    # An old copy without the token finds the run held; the copy with it resumes it, as no lost attempt.
    assert begin(conn, "old-copy")[1] is False
    resumed, started = begin(conn, "new", resume="sweep-1")
    assert started and (resumed.lease_holder, resumed.lost_attempts) == ("new", 1)


def test_a_sleeping_run_past_its_wake_up_is_sent_again_under_its_own_token(conn):
    from datetime import timedelta

    run, _ = begin(conn, "sleeper")
    assert runs.hand_off_to_sleep(conn, "r1", "sleeper", store_now(conn) - timedelta(seconds=5))
    [overdue] = runs.stranded(conn, store_now(conn) - timedelta(seconds=1), store_now(conn), 10)
    assert overdue.state == "sleeping"
    assert runs.hand_off_to_resend(conn, overdue, "unused", store_now(conn)) == "sleeper"
    # Due again from now: not sent again within the next TTL.
    assert runs.stranded(conn, store_now(conn) - timedelta(seconds=1), store_now(conn), 10) == []
    woke, started = begin(conn, "wake", resume="sleeper")
    assert started and woke.lost_attempts == 0


def test_a_checkpoint_is_stored_only_while_its_attempt_holds_the_run(conn):
    begin(conn, "a1", ttl=0.2)
    assert steps.insert(conn, "r1", StepKey("charge", 0), '"ch-1"', "a1")
    wait_for(lambda: not runs.get(conn, "r1").lease_live(store_now(conn)), timeout=5, what="the lease to expire")
    begin(conn, "a2")
    # a1's process froze past its lease and a2 took the run: a1's next checkpoint is fenced out.
    assert not steps.insert(conn, "r1", StepKey("ship", 0), '"late"', "a1")
    assert steps.load(conn, "r1") == {StepKey("charge", 0): '"ch-1"'}
    assert steps.insert(conn, "r1", StepKey("ship", 0), '"ok"', "a2")
    # A cancelled run names no holder: its attempt's next checkpoint is fenced out too.
    runs.cancel(conn, run_id="r1", task_name="t", queue="q", args="[]", kwargs="{}", reason="revoked")
    assert not steps.insert(conn, "r1", StepKey("receipt", 0), '"r"', "a2")
    assert set(steps.load(conn, "r1")) == {StepKey("charge", 0), StepKey("ship", 0)}


# PostgreSQL only (SQLite has one writer at a time: a takeover cannot run beside an open write transaction).
@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_a_takeover_waits_for_a_checkpoint_in_flight_then_sees_it(store_url, conn):
    """PostgreSQL: the fence locks the run row FOR SHARE until its transaction ends, so a takeover that
    starts while a (transactional) checkpoint is in flight waits for its commit, then loads the step."""
    begin(conn, "a1", ttl=0.2)
    wait_for(lambda: not runs.get(conn, "r1").lease_live(store_now(conn)), timeout=5, what="the lease to expire")
    engine = ensure_schema(store_url)
    taker = autocommit(engine).connect()
    taker_pid = taker.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    taken: list[tuple[bool, dict[StepKey, str]]] = []

    def take_over() -> None:
        _, started = begin(taker, "a2")
        taken.append((started, steps.load(taker, "r1")))

    thread = threading.Thread(target=take_over)
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
    assert taken == [(True, {StepKey("ledger", 0): '"ledger"'})]


def test_a_settled_outcome_names_its_settler_and_is_claimed_once_by_that_token(conn):
    run, _ = begin(conn, "a1")
    settled = runs.settle(conn, run, "succeeded", result="1")
    assert settled is not None and settled.settled_by == "a1" and runs.get(conn, "r1").settled_by == "a1"
    assert runs.claim_unseen_outcome(conn, "r1", "a2") is None  # another attempt's token claims nothing
    claimed = runs.claim_unseen_outcome(conn, "r1", "a1")
    assert claimed is not None and (claimed.state, claimed.result, claimed.settled_by) == ("succeeded", "1", None)
    assert runs.claim_unseen_outcome(conn, "r1", "a1") is None  # a second copy of the settler's re-send
    assert (runs.get(conn, "r1").settled_by, runs.get(conn, "r1").state) == (None, "succeeded")
    # A failed attempt (it will retry) settles nothing; a dead run requeued has no settler left to claim it.
    failing, _ = begin(conn, "b1", run_id="r2")
    assert runs.settle(conn, failing, "failed", error="E: boom").settled_by is None
    again, _ = begin(conn, "b2", run_id="r2")
    runs.settle(conn, again, "dead", error="E: boom")
    assert runs.get(conn, "r2").settled_by == "b2"
    assert runs.reopen(conn, "r2", store_now(conn))
    assert runs.get(conn, "r2").settled_by is None
