"""When the claimer's next pass runs: kicks from any thread coalesce into one pass on the loop thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: Seconds between a delivery admitted outside a pass and the pass that fills the rest of the room.
FOLLOW_UP_PASS_DELAY = 0.001


class PassKicks:
    """Coalesces kicks into one scheduled pass; ``pending`` while one is scheduled and has not started."""

    def __init__(self, schedule: Callable[[Callable[[], None]], None], run_pass: Callable[[], Any],
                 hub: Any = None) -> None:
        self._schedule = schedule
        self._run_pass = run_pass
        self._hub = hub
        self._lock = threading.Lock()
        self.pending = False

    def kick(self) -> None:
        """Ask for a pass soon; many kicks before it runs make one pass."""
        with self._lock:
            if self.pending:
                return
            self.pending = True
        self._schedule(self.kicked)

    def kicked(self) -> None:
        """The scheduled pass (or the first one, run at once): no longer pending once it starts."""
        with self._lock:
            self.pending = False
        self._run_pass()

    def after_next_poll(self) -> None:
        """A pass once the hub has polled again (without a hub: now).

        After a delivery admitted outside a pass: Celery's pool writes the job just admitted to a child only
        when the hub's next poll finds the child's pipe writable; a pass kicked at once would run first and
        hold the job back by a claim round trip (measured on the PostgreSQL broker's idle pickup). A timer
        due in a millisecond fires on the round after that poll.
        """
        if self._hub is not None:
            self._hub.call_later(FOLLOW_UP_PASS_DELAY, self.kick)
        else:
            self.kick()

