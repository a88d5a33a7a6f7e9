"""Pure: the fleet rate limit's arithmetic (GCRA) and what a checked message does with the store's answer.

A rate of ``count`` per ``period`` lets one run start every ``interval =
period / count`` seconds, evenly, with ``burst`` starts allowed back to back.
The state is one timestamp per task, the theoretical arrival time (TAT): the
moment the next run could start at the steady rate. A message that is early
does not come back to ask again (that is a busy loop): it *books* the next
start, moving the TAT on, and waits in the store until its booked time.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

#: What the gate does with a message once the store has answered.
RUN = "run"            # every lease taken: hand it to Celery
WAIT = "wait"          # a scope is busy or its rate turn is later: parked in the store, acked
DROP = "drop"          # a scope is busy and the task drops when busy: acked, counted, not run
FAIL = "fail"          # the task's key function failed for this message: the run fails, named


@dataclass(frozen=True)
class RateTurn:
    """When a run may start, and the TAT once it has booked that start."""

    start_at: datetime
    tat: datetime

    def waits(self, now: datetime) -> bool:
        return self.start_at > now


def book_rate_turn(tat: datetime | None, now: datetime, interval: float, burst: int = 1) -> RateTurn:
    """Book the next start of a task rate limited to one per ``interval`` s (``burst`` back to back).

    A run may start once ``now`` reaches ``TAT - (burst - 1) * interval``; a
    run that must wait books that time, so each waiting message holds its own
    turn and the turns stay ``interval`` apart however many are waiting.
    """
    if interval <= 0 or burst < 1:
        raise ValueError(f"interval must be > 0 and burst >= 1, got {interval!r}, {burst!r}")
    current = now if tat is None or tat < now else tat
    tolerance = timedelta(seconds=interval * (burst - 1))
    start_at = max(now, current - tolerance)
    return RateTurn(start_at=start_at, tat=current + timedelta(seconds=interval))


def return_rate_turn(tat: datetime, interval: float) -> datetime:
    """The TAT after a booked turn is given back (its run never started): one interval earlier."""
    return tat - timedelta(seconds=interval)
