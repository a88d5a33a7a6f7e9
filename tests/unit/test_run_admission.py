"""The admission rules of a durable run's delivery, from tables: run, drop, defer or bury; the store wait."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from celery_durable.planning.run_admission import (
    BURY,
    DEFER,
    DEFER_MARGIN,
    DUPLICATE,
    RUN,
    STORE_WAIT_CAP,
    UNSEEN_OUTCOME,
    RowView,
    Verdict,
    admit,
    store_wait_delay,
    wait_in_place,
)

AT = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)
SETTLED = frozenset({"succeeded", "dead", "cancelled"})


def view(state: str = "running", holder: str | None = "t1", expires_in: float | None = 10.0,
         lost: int = 0, settled_by: str | None = None) -> RowView:
    expires = None if expires_in is None else AT + timedelta(seconds=expires_in)
    return RowView(state, holder, expires, lost, settled_by)


def verdict(row: RowView, *, started: bool, retries: int = 0, max_retries: int | None = 3,
            resume: str | None = None):
    return admit(row, started=started, settled_states=SETTLED, sleeping_state="sleeping", retries=retries,
                 max_retries=max_retries, at=AT, resume=resume)


@pytest.mark.parametrize(("row", "started", "retries", "max_retries", "kind"), [
    # Took the lease: run, unless lost attempts (and failed ones) used up the budget.
    (view(lost=0), True, 0, 3, RUN),
    (view(lost=3), True, 0, 3, RUN),        # the 4th start of a crash loop still runs
    (view(lost=4), True, 0, 3, BURY),       # max_retries + 1 starts without an end: no 5th
    (view(lost=2), True, 2, 3, BURY),       # two failures and two lost attempts share the budget
    (view(lost=1), True, 3, 3, BURY),
    (view(lost=0), True, 5, 3, RUN),        # failures alone are Celery's retry policy, not ours
    (view(lost=50), True, 0, None, RUN),    # max_retries=None: retried without end
    (view(lost=1), True, 0, 0, BURY),       # no retries: the first lost attempt was the only one
    # Did not take it: settled or sleeping copies are dropped; a live holder defers the copy.
    (view("succeeded", None, None), False, 0, 3, DUPLICATE),
    (view("cancelled", None, None), False, 0, 3, DUPLICATE),
    (view("dead", None, None), False, 0, 3, DUPLICATE),
    (view("sleeping", "t1", None), False, 0, 3, DUPLICATE),
    (view("running", "t1", 10.0), False, 0, 3, DEFER),
    (view("failed", "t1", 10.0), False, 0, 3, DEFER),
])
def test_a_delivery_runs_drops_defers_or_buries(row, started, retries, max_retries, kind):
    assert verdict(row, started=started, retries=retries, max_retries=max_retries).kind == kind


@pytest.mark.parametrize(("row", "resume", "kind"), [
    # The settler's own re-send (its token in durable_resume) on the outcome it wrote: it claims it.
    (view("succeeded", None, None, settled_by="t1"), "t1", UNSEEN_OUTCOME),
    (view("dead", None, None, settled_by="t1"), "t1", UNSEEN_OUTCOME),
    # Any other copy, or the outcome already claimed (cleared) or written by another attempt: dropped.
    (view("succeeded", None, None, settled_by="t1"), None, DUPLICATE),
    (view("succeeded", None, None, settled_by="t2"), "t1", DUPLICATE),
    (view("succeeded", None, None, settled_by=None), "t1", DUPLICATE),
    (view("sleeping", "t1", None, settled_by=None), "t1", DUPLICATE),
])
def test_only_the_settlers_own_re_send_claims_the_outcome_it_never_heard(row, resume, kind):
    assert verdict(row, started=False, resume=resume).kind == kind


@pytest.mark.parametrize(("expires_in", "delay"), [
    (10.0, 10.0 + DEFER_MARGIN),
    (0.25, 0.25 + DEFER_MARGIN),
    (-3.0, DEFER_MARGIN),   # expired between the begin statement and the read: look again at once
    (None, DEFER_MARGIN),
])
def test_a_deferred_copy_looks_again_just_after_the_live_lease_would_expire(expires_in, delay):
    got = verdict(view(expires_in=expires_in), started=False)
    assert got.kind == DEFER
    assert got.delay == pytest.approx(delay)


def test_a_buried_run_says_why():
    got = verdict(view(lost=4), started=True)
    assert "started 4 times without an end" in got.reason and "max_retries=3" in got.reason


@pytest.mark.parametrize(("waits", "jitter", "delay"), [
    (0, 0.0, 0.5), (1, 0.0, 1.0), (2, 0.0, 2.0), (4, 0.0, 8.0), (5, 0.0, STORE_WAIT_CAP),
    (500, 0.0, STORE_WAIT_CAP), (-1, 0.0, 0.5), (0, 0.5, 0.625), (5, 0.999, STORE_WAIT_CAP * 1.4995),
])
def test_the_store_wait_doubles_to_a_cap_with_jitter(waits, jitter, delay):
    assert store_wait_delay(waits, jitter) == pytest.approx(delay)


@pytest.mark.parametrize("jitter", [-0.1, 1.0, 2.0])
def test_a_jitter_outside_the_unit_interval_is_refused(jitter):
    with pytest.raises(ValueError, match="jitter"):
        store_wait_delay(0, jitter)


T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)
RENEWED = T0 + timedelta(seconds=10)


@pytest.mark.parametrize(("kind", "delay", "expires", "seen", "looks", "wait"), [
    (DEFER, 0.66, T0, None, 0, 0.66),       # lapses within the watch: wait for it
    (DEFER, 2.9, T0, None, 0, 1.5),         # watch a third of the TTL (3 s) plus the margin
    (DEFER, 1.4, T0, T0, 1, 1.4),           # not renewed during the watch: a dead holder's, wait on
    (DEFER, 2.9, RENEWED, T0, 1, None),     # renewed since the last look: a live holder, re-send
    (DEFER, 0.2, T0, T0, 5, None),          # looked enough: re-send
    (DUPLICATE, 0.0, T0, None, 0, None),
    (RUN, 0.0, T0, None, 0, None),
])
def test_a_copy_watches_a_lease_in_place_and_goes_back_to_the_broker_once_it_is_renewed(
        kind, delay, expires, seen, looks, wait):
    assert wait_in_place(Verdict(kind, delay=delay), expires, seen, looks, 3.0) == wait
