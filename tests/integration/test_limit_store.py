"""The fleet-limit SQL on PostgreSQL and SQLite: leases per scope, parked messages, turns, reclaiming."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.planning.limit_declarations import Rate, Scope
from celery_durable.planning.limits import RUN, WAIT, Decision, LimitAsk
from celery_durable.store import limit_declarations, limit_waiting, schema
from celery_durable.store import limits as store
from celery_durable.store.engine import autocommit, engine_for, ensure_schema
from tests.stores import fresh_store
from tests.threads import run_together

now = SYSTEM_CLOCK.now


def _message(task_id: str) -> limit_waiting.WaitingMessage:
    return limit_waiting.WaitingMessage(task_id=task_id, queue="q", exchange="", routing_key="q", body=b'[[], {}, {}]',
                                headers=json.dumps({"id": task_id}), properties="{}",
                                content_type="application/json", content_encoding="utf-8")


def _take(url: str, asks: list[LimitAsk], holder: str = "h1", ttl: float = 30.0, at=None) -> list[Decision]:
    with engine_for(url).begin() as conn:
        return store.take_batch(conn, asks, [_message(a.task_id) for a in asks], holder=holder, ttl=ttl,
                                now=at or now())[0]


def _release(url: str, task_id: str, scope: Scope, holder: str = "h1", at=None) -> int:
    with engine_for(url).begin() as conn:
        return store.release(conn, [store.Return("t", task_id, (scope,))], holder=holder, ttl=30.0,
                             now=at or now())


def test_a_freed_lease_goes_to_the_oldest_waiter_which_takes_it_when_it_comes_back(store_url):
    ensure_schema(store_url)
    scope = Scope("t", "task", "", 2)
    answers = _take(store_url, [LimitAsk("t", f"r{i}", (scope,), None, WAIT) for i in range(5)])
    assert [a.verdict for a in answers] == [RUN, RUN, WAIT, WAIT, WAIT]
    assert _release(store_url, "r0", scope) == 1
    with engine_for(store_url).begin() as conn:
        ready = limit_waiting.claim_ready(conn, 10, now())
        assert [row.message.task_id for row in ready] == ["r2"]
        limit_waiting.forget(conn, [row.id for row in ready])
    # A new message arriving now queues behind the waiters; r2, back from the broker, takes its booking.
    answers = _take(store_url, [LimitAsk("t", "new", (scope,), None, WAIT), LimitAsk("t", "r2", (scope,), None, WAIT)])
    assert [a.verdict for a in answers] == [WAIT, RUN]
    with engine_for(store_url).connect() as conn:
        assert store.held(conn, now()) == [("t", "task", "", 2)]
        assert limit_waiting.waiting_counts(conn) == [("t", "task", "", 3)]


def test_a_dead_holders_lease_is_reclaimed_after_its_ttl(store_url):
    ensure_schema(store_url)
    scope = Scope("t", "key", "org:a", 1)
    t0 = now()
    assert [a.verdict for a in _take(store_url, [LimitAsk("t", "a1", (scope,), None, WAIT)], holder="dead",
                                     ttl=3.0, at=t0)] == [RUN]
    assert [a.verdict for a in _take(store_url, [LimitAsk("t", "a2", (scope,), None, WAIT)], holder="alive",
                                     at=t0 + timedelta(seconds=1))] == [WAIT]
    with engine_for(store_url).begin() as conn:
        assert store.sweep(conn, {("t", "key"): 1}, 30.0, t0 + timedelta(seconds=2)) == 0  # still live
        assert store.sweep(conn, {("t", "key"): 1}, 30.0, t0 + timedelta(seconds=4)) == 1  # expired: a2 is next
        assert [row.message.task_id for row in limit_waiting.claim_ready(conn, 10, t0 + timedelta(seconds=4))] == ["a2"]


def test_renewal_keeps_a_holders_leases_past_their_first_ttl(store_url):
    ensure_schema(store_url)
    scope = Scope("t", "task", "", 1)
    t0 = now()
    _take(store_url, [LimitAsk("t", "a1", (scope,), None, WAIT)], holder="h", ttl=3.0, at=t0)
    with engine_for(store_url).begin() as conn:
        assert store.renew(conn, "h", 3.0, t0 + timedelta(seconds=2)) == 1
        assert store.sweep(conn, {("t", "task"): 1}, 3.0, t0 + timedelta(seconds=4)) == 0
        assert store.held(conn, t0 + timedelta(seconds=4)) == [("t", "task", "", 1)]


def test_an_early_message_waits_for_its_booked_turn_and_runs_on_it(store_url):
    ensure_schema(store_url)
    rate = Rate(60, 60.0)
    t0 = now()
    answers = _take(store_url, [LimitAsk("t", f"r{i}", (), rate, WAIT) for i in range(3)], at=t0)
    assert [a.verdict for a in answers] == [RUN, WAIT, WAIT]
    assert [a.publish_at for a in answers[1:]] == [t0 + timedelta(seconds=1), t0 + timedelta(seconds=2)]
    with engine_for(store_url).begin() as conn:
        assert limit_waiting.claim_ready(conn, 10, t0 + timedelta(seconds=0.5)) == []
        due = limit_waiting.claim_ready(conn, 10, t0 + timedelta(seconds=1))
        assert [row.message.task_id for row in due] == ["r1"]
        limit_waiting.forget(conn, [row.id for row in due])
    answers = _take(store_url, [LimitAsk("t", "r1", (), rate, WAIT), LimitAsk("t", "late", (), rate, WAIT)],
                    at=t0 + timedelta(seconds=1))
    assert answers[0].verdict == RUN and answers[0].holds_rate_turn
    assert answers[1].publish_at == t0 + timedelta(seconds=3), "a new message books after the turns already booked"


def test_never_over_the_limit_under_racing_takers(store_url):
    """Six threads, each its own connection, take and release leases of a scope with limit 3: the
    leases held (read in the store after each take) and the runs holding one never exceed 3."""
    ensure_schema(store_url)
    scope = Scope("t", "task", "", 3)
    running = 0
    peak = 0
    lock = threading.Lock()

    def worker(n: int) -> None:
        nonlocal running, peak
        for i in range(25):
            task_id = f"w{n}-{i}"
            if _take(store_url, [LimitAsk("t", task_id, (scope,), None, "drop")], holder=f"h{n}")[0].verdict != RUN:
                continue
            with engine_for(store_url).connect() as conn:
                held = sum(count for *_, count in store.held(conn, now()))
            with lock:
                running += 1
                peak = max(peak, running, held)
            with lock:
                running -= 1
            _release(store_url, task_id, scope, holder=f"h{n}")

    run_together(worker, 6)
    assert 1 <= peak <= 3
    with engine_for(store_url).connect() as conn:
        assert store.held(conn, now()) == []


def test_a_copy_meeting_a_full_scope_while_its_ready_row_is_on_its_way_keeps_that_row(store_url):
    """The row made ready for a message is what publishes it: a copy that arrives and must wait again
    puts that row back to waiting (in its first place), never acks itself away beside a row about to go."""
    ensure_schema(store_url)
    scope = Scope("t", "task", "", 1)
    assert [a.verdict for a in _take(store_url, [LimitAsk("t", f"r{i}", (scope,), None, WAIT) for i in range(3)])] \
        == [RUN, WAIT, WAIT]
    _release(store_url, "r0", scope)  # r1 made ready: booked, publish_at set
    # r1's booking lapses and a newcomer takes the lease before r1's copy arrives.
    with engine_for(store_url).begin() as conn:
        conn.execute(schema.limit_leases.delete().where(schema.limit_leases.c.task_id == "r1"))
    assert _take(store_url, [LimitAsk("t", "new", (scope,), None, WAIT)])[0].verdict == WAIT
    with engine_for(store_url).begin() as conn:
        conn.execute(schema.limit_leases.insert().values(task_name="t", kind="task", key="", task_id="x", holder="h2",
                                                         expires_at=now() + timedelta(seconds=30)))
    assert _take(store_url, [LimitAsk("t", "r1", (scope,), None, WAIT)])[0].verdict == WAIT
    with engine_for(store_url).connect() as conn:
        rows = conn.execute(sa.select(schema.limit_waiting.c.task_id, schema.limit_waiting.c.publish_at)
                            .order_by(schema.limit_waiting.c.id)).all()
    # r1 waits again in its first place; r2 took the lease the lapse freed (waiters go before newcomers).
    assert [(task_id, publish_at is None) for task_id, publish_at in rows] == [("r1", True), ("r2", False),
                                                                                 ("new", True)]


# -- the one-round-trip exchange (PostgreSQL) ------------------------------------------------------
@pytest.fixture
def pg_url(tmp_path: Path) -> Iterator[str]:
    with fresh_store("postgresql", tmp_path) as url:
        ensure_schema(url)
        yield url


def _exchange(url: str, returns: list[store.Return], asks: list[LimitAsk], holder: str = "h1",
              at=None) -> tuple[bool, bool]:
    with autocommit(engine_for(url)).connect() as conn:
        return store.exchange(conn, returns, asks, holder=holder, ttl=30.0, now=at or now())


def _held_ids(url: str) -> list[str]:
    with engine_for(url).connect() as conn:
        return sorted(conn.execute(sa.select(schema.limit_leases.c.task_id)).scalars())


def test_exchange_takes_leases_only_when_all_fit_and_gives_back_first(pg_url):
    scope = Scope("t", "task", "", 2)
    ask = lambda task_id: LimitAsk("t", task_id, (scope,), None, WAIT)  # noqa: E731
    assert _exchange(pg_url, [], [ask("a"), ask("b")]) == (True, False)
    assert _held_ids(pg_url) == ["a", "b"]
    assert _exchange(pg_url, [], [ask("c")]) == (False, False), "a full scope takes nothing"
    # a's lease goes back in the same call that takes c's: the give-back comes first.
    assert _exchange(pg_url, [store.Return("t", "a", (scope,))], [ask("c")]) == (True, False)
    assert _held_ids(pg_url) == ["b", "c"]
    # Room for one, two asked: all or nothing.
    assert _exchange(pg_url, [store.Return("t", "b", (scope,))], [ask("d"), ask("e")]) == (False, False)
    assert _held_ids(pg_url) == ["c"]


def test_exchange_leaves_to_the_general_path_what_it_must_decide(pg_url):
    """Waiters go first, a copy of a run that holds a lease or waits, another holder's lease is not
    given back: each answers not taken, and the general transaction then decides as it always did."""
    scope = Scope("t", "key", "org:a", 1)
    ask = lambda task_id: LimitAsk("t", task_id, (scope,), None, WAIT)  # noqa: E731
    assert [d.verdict for d in _take(pg_url, [ask("a"), ask("w")])] == [RUN, WAIT]
    assert _exchange(pg_url, [], [ask("a")]) == (False, False), "a copy of a running run"
    assert _exchange(pg_url, [store.Return("t", "a", (scope,))], [], holder="other") == (True, True)
    assert _held_ids(pg_url) == ["a"], "another holder cannot give back a's lease"
    # a ends: its scope has a waiter (told), and a newcomer does not jump the queue.
    assert _exchange(pg_url, [store.Return("t", "a", (scope,))], [ask("n")]) == (False, True)
    assert _held_ids(pg_url) == []
    assert _release(pg_url, "a", scope) == 1, "the general release makes the waiter ready"
    assert _exchange(pg_url, [], [ask("w")]) == (False, False), "w's copy takes its booking by the general path"
    assert [d.verdict for d in _take(pg_url, [ask("w")])] == [RUN]


def test_exchange_reclaims_a_dead_holders_expired_lease(pg_url):
    scope = Scope("t", "task", "", 1)
    t0 = now()
    with engine_for(pg_url).begin() as conn:
        conn.execute(schema.limit_leases.insert().values(task_name="t", kind="task", key="", task_id="dead",
                                                         holder="gone", expires_at=t0 - timedelta(seconds=1)))
    assert _exchange(pg_url, [], [LimitAsk("t", "r", (scope,), None, WAIT)], at=t0) == (True, False)
    assert _held_ids(pg_url) == ["r"]


def test_exchange_refuses_what_it_does_not_keep(pg_url):
    rated = LimitAsk("t", "r", (), Rate(1, 1.0), WAIT)
    scope = Scope("t", "task", "", 3)
    with pytest.raises(ValueError, match="scopes only"):
        _exchange(pg_url, [], [rated])
    with pytest.raises(ValueError, match="one copy"):
        _exchange(pg_url, [], [LimitAsk("t", "r", (scope,), None, WAIT)] * 2)
    with pytest.raises(ValueError, match="rate turns"):
        _exchange(pg_url, [store.Return("t", "r", (scope,), Rate(1, 1.0))], [])


def test_exchange_never_over_the_limit_beside_the_general_path(pg_url):
    """Six threads, half taking through the exchange and half through the general transaction, on one
    scope of limit 2: the leases held, read after every take, never exceed 2."""
    scope = Scope("t", "task", "", 2)
    peak = 0
    lock = threading.Lock()

    def worker(n: int) -> None:
        nonlocal peak
        held: list[str] = []
        for i in range(30):
            task_id = f"w{n}-{i}"
            ask = LimitAsk("t", task_id, (scope,), None, "drop")
            returns = [store.Return("t", gone, (scope,)) for gone in held]
            if n % 2:
                taken, _ = _exchange(pg_url, returns, [ask], holder=f"h{n}")
            else:
                for gone in held:
                    _release(pg_url, gone, scope, holder=f"h{n}")
                taken = _take(pg_url, [ask], holder=f"h{n}")[0].verdict == RUN
            held = [task_id] if taken else []
            with engine_for(pg_url).connect() as conn:
                count = sum(n for *_, n in store.held(conn, now()))
            with lock:
                peak = max(peak, count)

    run_together(worker, 6)
    assert 1 <= peak <= 2


def _declare(url: str, holder: str, limit: int, ttl: float = 30.0) -> dict[tuple[str, str], tuple[int, int]]:
    with engine_for(url).begin() as conn:
        return limit_declarations.declare(conn, holder, {("t", "task"): limit}, ttl, now())


def test_the_lowest_limit_a_live_worker_declares_applies_to_every_worker(store_url):
    """A rolling deploy: one worker declares concurrency 1, another 3. Each used to check its own,
    so the loosest applied (3 at once); the strictest now applies to both, until its worker leaves."""
    ensure_schema(store_url)
    assert _declare(store_url, "strict", 1) == {("t", "task"): (1, 1)}
    assert _declare(store_url, "loose", 3) == {("t", "task"): (1, 3)}, "the second worker sees both values"
    loose = Scope("t", "task", "", 3)
    ask = lambda task_id: LimitAsk("t", task_id, (loose,), None, WAIT)  # noqa: E731
    assert [d.verdict for d in _take(store_url, [ask("a"), ask("b")], holder="loose")] == [RUN, WAIT]
    assert [d.verdict for d in _take(store_url, [ask("c")], holder="loose")] == [WAIT]
    # The waiter behind the strict limit is made ready only when the one lease goes back.
    assert _release(store_url, "a", loose, holder="loose") == 1
    with engine_for(store_url).begin() as conn:
        store.release_holder(conn, "strict")  # the strict worker leaves: its declaration with it
        assert store.sweep(conn, {("t", "task"): 3}, 30.0, now()) == 1, "room for the other waiter now"


def test_a_dead_workers_declaration_expires_with_its_ttl(store_url):
    ensure_schema(store_url)
    _declare(store_url, "dead", 1, ttl=1.0)
    _declare(store_url, "live", 3)
    loose = Scope("t", "task", "", 3)
    asks = [LimitAsk("t", task_id, (loose,), None, WAIT) for task_id in "ab"]
    assert [d.verdict for d in _take(store_url, asks, holder="live", at=now() + timedelta(seconds=5))] == [RUN, RUN]


def test_exchange_applies_the_lowest_declared_limit(pg_url):
    ensure_schema(pg_url)
    _declare(pg_url, "strict", 1)
    _declare(pg_url, "loose", 3)
    loose = Scope("t", "task", "", 3)
    ask = lambda task_id: LimitAsk("t", task_id, (loose,), None, WAIT)  # noqa: E731
    assert _exchange(pg_url, [], [ask("a"), ask("b")], holder="loose") == (False, False), "two do not fit under 1"
    assert _exchange(pg_url, [], [ask("a")], holder="loose") == (True, False)
    assert _exchange(pg_url, [], [ask("c")], holder="loose") == (False, False)
    assert _held_ids(pg_url) == ["a"]
