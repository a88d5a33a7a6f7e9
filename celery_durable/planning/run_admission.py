"""Pure: what a delivery of a durable run does once the store has answered whether it may start.

A delivery either starts an attempt (it took the run's lease), or it finds the
run settled, sleeping until its own wake-up, or held by a live attempt. These
rules decide, from the row and the message alone, whether to run, drop the
copy, put it off until the live lease would have expired, or bury a run whose
attempts keep dying; and how long a delivery waits while the store is down.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

#: Verdicts.
RUN = "run"              # this delivery took the lease: execute the body
DUPLICATE = "duplicate"  # the run settled, or sleeps until a wake-up that exists: ack this copy
#: The run settled under the very attempt that re-sent this message, whose settle's reply was lost:
#: this delivery claims the outcome (counts it, calls ``on_settled``) if no copy did first, then acks.
UNSEEN_OUTCOME = "unseen_outcome"
DEFER = "defer"          # a live attempt holds the run: re-send this copy to look again later
BURY = "bury"            # started too many times without an end: settle dead, never start again

#: Seconds past a live lease's expiry a deferred copy comes back: the holder's
#: last renewal may land just before the expiry it read.
DEFER_MARGIN = 0.5

#: The wait before a delivery retries a store that did not answer: doubling from
#: the base to the cap, so a long outage costs a few messages per run, not a spin.
STORE_WAIT_BASE = 0.5
STORE_WAIT_CAP = 10.0


@dataclass(frozen=True)
class RowView:
    """What the admission rules read of a run's row (as the begin statement left or found it)."""

    state: str
    lease_holder: str | None
    lease_expires_at: datetime | None
    lost_attempts: int
    settled_by: str | None = None


@dataclass(frozen=True)
class Verdict:
    kind: str
    #: DEFER: seconds until the copy should look again.
    delay: float = 0.0
    #: BURY: why, for the run's last error.
    reason: str = ""


def admit(row: RowView, *, started: bool, settled_states: frozenset[str], sleeping_state: str,
          retries: int, max_retries: int | None, at: datetime, resume: str | None = None) -> Verdict:
    """The verdict for one delivery; ``started`` says whether the begin statement took the lease.

    ``retries`` is the delivered message's retry count and ``max_retries`` the
    task's (None: retried without end, so never buried for lost attempts). An
    attempt lost to a dead process spends the retry budget like a failed one:
    with ``max_retries = 3`` a run is started at most 4 times without an end.
    ``resume`` is the hand-off token the message carries: the settler's own
    token on a run it settled means the settler never heard its settle.
    """
    if started:
        if max_retries is not None and row.lost_attempts and retries + row.lost_attempts > max_retries:
            return Verdict(BURY, reason=(f"started {retries + row.lost_attempts} times without an end "
                                         f"(max_retries={max_retries}): each attempt's process died"))
        return Verdict(RUN)
    if row.state in settled_states and resume is not None and row.settled_by == resume:
        return Verdict(UNSEEN_OUTCOME)
    if row.state in settled_states or row.state == sleeping_state:
        return Verdict(DUPLICATE)
    expires = row.lease_expires_at
    remaining = (expires - at).total_seconds() if expires is not None else 0.0
    return Verdict(DEFER, delay=max(remaining, 0.0) + DEFER_MARGIN)


#: How long a copy watches a live lease before it decides: a live holder renews every third of the TTL
#: (leases/keeper.py), so a lease not renewed in that time (and a margin) is a dead holder's.
WATCH_SHARE = 1.0 / 3.0
#: Looks a copy takes in place at most (a dead holder's lease lapses within a TTL: about three watches).
MAX_LOOKS_IN_PLACE = 5


def wait_in_place(verdict: Verdict, expires: datetime | None, seen_expires: datetime | None, looks: int,
                  lease_ttl: float) -> float | None:
    """Seconds a DEFER verdict's copy should wait here before looking again; None to re-send it.

    Re-sent, the copy queues behind every message sent since (under a backlog, minutes), so a copy
    first watches the lease: if it lapses within the watch, or is not renewed during one (its holder
    died: a redelivery after a lost connection, a restored message), the copy waits it out here and
    takes the run over. A lease that was renewed since the last look has a live holder: re-send.
    ``expires``: the lease's expiry now; ``seen_expires``: at the previous look (None: first look).
    """
    if verdict.kind != DEFER or looks >= MAX_LOOKS_IN_PLACE:
        return None
    if seen_expires is not None and expires != seen_expires:
        return None  # renewed since the last look: its holder is alive
    watch = lease_ttl * WATCH_SHARE + DEFER_MARGIN
    return min(verdict.delay, watch)


def store_wait_delay(waits: int, jitter: float, *, base: float = STORE_WAIT_BASE,
                     cap: float = STORE_WAIT_CAP) -> float:
    """Seconds a delivery waits before asking an unreachable store again, after ``waits`` earlier waits.

    ``jitter`` in [0, 1) spreads the retries of many runs (up to +50 %), so a
    store coming back is not hit by every waiting run in the same instant.
    """
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be in [0, 1), got {jitter!r}")
    delay = min(cap, base * 2.0 ** min(max(waits, 0), 32))
    return delay * (1.0 + 0.5 * jitter)
