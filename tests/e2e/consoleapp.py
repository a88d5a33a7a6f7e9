"""The app of the console's panels end-to-end test: the beat app's schedule, the fleet-limit tasks, and a durable
task that sleeps, on ``e2eapp``'s one app, so one worker, one beat and the dashboard share it."""

from __future__ import annotations

from typing import Any

import tests.e2e.beatapp  # its schedule (E2E_BEAT) and beat.tick
import tests.e2e.limitsapp  # noqa: F401 - limits.sync_org: one run per org at a time, the others wait
from tests.e2e.e2eapp import app, observe


@app.durable_task(bind=True, name="console.nap")
def nap(self: Any, label: str, seconds: float) -> str:
    """Sleeps durably for ``seconds``: a run in the store waiting for a time."""
    observe("start", label, id=self.request.id)
    self.sleep("nap", seconds)
    observe("end", label, id=self.request.id)
    return label
