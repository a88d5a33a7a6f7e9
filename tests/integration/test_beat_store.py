"""The durable beat's SQL on PostgreSQL and SQLite: one leader per beat, fenced fires, watermarks."""

from __future__ import annotations

import threading
from datetime import timedelta

from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.store import beat as store
from celery_durable.store.engine import engine_for, ensure_schema
from tests.threads import run_together

now = SYSTEM_CLOCK.now


def _lead(url: str, holder: str, at, ttl: float = 10.0) -> int | None:
    with engine_for(url).begin() as conn:
        return store.lead(conn, "b", holder, ttl, at)


def test_one_replica_leads_until_its_lease_expires_then_another_takes_over_under_a_new_term(store_url):
    ensure_schema(store_url)
    t0 = now()
    assert _lead(store_url, "r1", t0) == 1
    assert _lead(store_url, "r2", t0 + timedelta(seconds=1)) is None
    assert _lead(store_url, "r1", t0 + timedelta(seconds=5)) == 1, "renewed under the same term"
    assert _lead(store_url, "r2", t0 + timedelta(seconds=14)) is None, "renewed at +5 s: live until +15 s"
    assert _lead(store_url, "r2", t0 + timedelta(seconds=16)) == 2
    assert _lead(store_url, "r1", t0 + timedelta(seconds=17)) is None
    with engine_for(store_url).begin() as conn:
        assert not store.still_leads(conn, "b", "r1", 1, t0 + timedelta(seconds=17)), "the old term is fenced"
        assert store.still_leads(conn, "b", "r2", 2, t0 + timedelta(seconds=17))
        assert store.release(conn, "b", "r2")
    assert _lead(store_url, "r1", t0 + timedelta(seconds=18)) == 3, "a released lease is taken at once"


def test_a_tick_fires_once_and_the_watermark_only_moves_forward(store_url):
    ensure_schema(store_url)
    t0 = now()
    with engine_for(store_url).begin() as conn:
        store.add_entry(conn, "b", "e", t0)
        store.add_entry(conn, "b", "e", t0 + timedelta(hours=1))  # kept as it was
        assert store.fire(conn, "b", "e", t0 + timedelta(seconds=1), t0 + timedelta(seconds=1), "id1", 1, t0)
        assert not store.fire(conn, "b", "e", t0 + timedelta(seconds=1), t0 + timedelta(seconds=1), "id1", 2, t0)
        store.advance(conn, "b", "e", t0)  # backwards: ignored
        state = store.entry_states(conn, "b")["e"]
        assert state.watermark == t0 + timedelta(seconds=1) and state.last_tick == t0 + timedelta(seconds=1)
        store.set_paused(conn, "b", "e", True, t0 + timedelta(seconds=2))
        assert store.entry_states(conn, "b")["e"].paused
        store.set_paused(conn, "b", "e", False, t0 + timedelta(seconds=9))
        resumed = store.entry_states(conn, "b")["e"]
        assert not resumed.paused and resumed.watermark == t0 + timedelta(seconds=9), "the paused ticks are not due"
        store.set_paused(conn, "b", "new", True, t0)
        assert store.entry_states(conn, "b")["new"] == store.EntryState(t0, True, None, None)
        assert [(e, task_id, term) for e, _, task_id, term in store.fired(conn, "b")] == [("e", "id1", 1)]


def test_racing_replicas_never_both_lead(store_url):
    """Eight threads, each a replica with its own connection, try to lead at the same instants: each
    round exactly one leads (the first round's winner keeps it), never two."""
    ensure_schema(store_url)
    t0 = now()
    leaders: dict[int, list[str]] = {}
    lock = threading.Lock()

    def replica(n: int) -> None:
        for round_ in range(10):
            if _lead(store_url, f"r{n}", t0 + timedelta(seconds=round_)) is not None:
                with lock:
                    leaders.setdefault(round_, []).append(f"r{n}")

    run_together(replica, 8)
    assert all(len(names) == 1 for names in leaders.values()), leaders
    assert len({names[0] for names in leaders.values()}) == 1


def test_old_sent_ticks_are_forgotten_and_the_watermark_keeps_its_place(store_url):
    ensure_schema(store_url)
    t0 = now()
    with engine_for(store_url).begin() as conn:
        store.add_entry(conn, "b", "e", t0)
        store.fire(conn, "b", "e", t0 + timedelta(seconds=1), t0 + timedelta(seconds=1), "old", 1,
                   t0 - timedelta(days=8))
        store.fire(conn, "b", "e", t0 + timedelta(seconds=2), t0 + timedelta(seconds=2), "new", 1, t0)
        assert store.prune_fires(conn, t0 - timedelta(days=7)) == 1
        assert [task_id for _, _, task_id, _ in store.fired(conn, "b")] == ["new"]
        assert store.entry_states(conn, "b")["e"].watermark == t0 + timedelta(seconds=2)
