"""The e2e app, whose worker SIGTERMs itself on the loop turn that hands a received task to the pool.

A SIGTERM landing on that turn is the race of tests/e2e/test_drain_race.py: the job reaches the child's
pipe, and the loop stops before it reads the child's ACK. Left to chance it takes a few milliseconds'
aim; here the signal is raised from the event loop's next turn, where the pool writes the job.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from celery import signals
from kombu.asynchronous import get_event_loop

from tests.e2e.e2eapp import app

__all__ = ["app"]


@signals.task_received.connect
def _sigterm_on_the_next_turn(request: Any, **_: Any) -> None:
    # Only for the one task the test names: a message of an earlier try that went back must run normally.
    if request.id != os.environ.get("E2E_SIGTERM_ON_TASK"):
        return

    def sigterm() -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    hub = get_event_loop()
    if hub is None or os.environ.get("E2E_SIGTERM_WHEN") == "now":
        # The rows broker delivers from a timer: the job is written later on this same turn.
        sigterm()
    else:
        # Redis delivers from the poll's events: the job is written on the next turn, after the
        # callbacks queued now run first thing.
        hub.call_soon(sigterm)
