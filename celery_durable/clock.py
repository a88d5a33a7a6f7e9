"""The one clock interface: a monotonic clock for intervals and deadlines, and wall time in UTC.

Every part that measures time takes a :class:`Clock` (``SYSTEM_CLOCK`` unless
a test gives ``celery_durable.testing.clock.FakeClock``): the worker runtime,
its claimer and drain, the fleet-limit gate, the outbox relay and the beat.
Leases are written in the store's time instead, which ``store/clock.py``
reads through this same interface (``StoreClock``).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Protocol


class Clock(Protocol):
    """``monotonic()``: seconds no wall-clock step moves; ``now()``: the wall time, an aware UTC datetime."""

    def monotonic(self) -> float: ...

    def now(self) -> datetime: ...


class SystemClock:
    """This host's clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(timezone.utc)


SYSTEM_CLOCK: Clock = SystemClock()
