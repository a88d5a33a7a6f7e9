"""FakeClock: a Clock a test moves by hand (both its monotonic and its wall time), counting its reads."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone

#: Where a FakeClock's wall time starts unless a test says otherwise.
EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc)


class FakeClock:
    """Stands still until the test moves it; ``reads`` counts the reads (a test waits for a thread to read it).

    ``advance(seconds)`` moves both clocks; ``set(monotonic)`` moves both to a
    monotonic reading (the wall time keeps the same distance from it).
    """

    def __init__(self, monotonic: float = 0.0, now: datetime = EPOCH) -> None:
        if now.tzinfo is None:
            raise ValueError("a FakeClock's wall time is an aware datetime")
        self._monotonic = monotonic
        self._wall = now
        self._lock = threading.Lock()
        self.reads = 0

    def monotonic(self) -> float:
        with self._lock:
            self.reads += 1
            return self._monotonic

    def now(self) -> datetime:
        with self._lock:
            self.reads += 1
            return self._wall

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._monotonic += seconds
            self._wall += timedelta(seconds=seconds)

    def set(self, monotonic: float) -> None:
        with self._lock:
            self._wall += timedelta(seconds=monotonic - self._monotonic)
            self._monotonic = monotonic
