"""The lease keeper's thread is woken by a hold only when its next beat would come too late for it."""

from __future__ import annotations

from typing import Any

from celery_durable.leases.keeper import LeaseKeeper
from tests.e2e.waiting import wait_for

URL = "sqlite:////nowhere/never-opened.sqlite"  # a TTL of 300 s: no beat, so no store, within the test


def test_a_hold_wakes_the_keeper_only_while_it_waits_for_a_first_lease():
    keeper = LeaseKeeper()
    wakes: list[int] = []
    notify = keeper._cond.notify

    def counted(n: int = 1) -> Any:
        wakes.append(n)
        return notify(n)

    keeper._cond.notify = counted  # type: ignore[method-assign]
    keeper.hold(URL, "first", "k0", 300.0)
    wait_for(lambda: keeper._next_due is not None, timeout=5, what="the keeper to schedule its first beat")
    assert len(wakes) == 1
    # Runs held and released one after another, as a pool child does: the beat already scheduled
    # renews whatever is held when it comes, so none of them wakes the thread.
    for i in range(50):
        keeper.hold(URL, f"r{i}", f"k{i}", 300.0)
        keeper.release(URL, f"r{i}")
    assert len(wakes) == 1
    assert keeper.held() == {URL: {"first": "k0"}}


def test_a_shorter_ttl_held_after_a_longer_one_is_renewed_within_a_third_of_it():
    # A broker's rows held on a 300 s TTL set the cadence at 100 s; a run lease of 0.6 s taken
    # afterwards must be renewed within 0.2 s, not at the beat set for the longer TTL, or it lapses.
    keeper = LeaseKeeper()
    keeper.hold_beat("long", lambda: None, 300.0)
    wait_for(lambda: keeper._next_due is not None, timeout=5, what="the keeper to schedule its first beat")
    renewed: list[int] = []
    keeper.hold_beat("short", lambda: renewed.append(1), 0.6)
    wait_for(lambda: len(renewed) >= 2, timeout=5, what="the short lease renewed on its own cadence")
    keeper.release_beat("short")
    keeper.release_beat("long")
