"""The app of the durable beat end-to-end tests: ``e2eapp`` plus a schedule read from the environment.

E2E_BEAT: JSON of entry name to ``{"every": seconds, "catch_up": policy}`` (or ``{"raw": {...}}`` for an
entry given as written, to test refusals); E2E_BEAT_FILE: a file holding that JSON instead (a config that
can change under a running replica). ``beat.tick`` records each send it runs with its task id and
the tick its headers name, so a test counts sends by task id at the worker.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tests.e2e.e2eapp import _queue_of, app, observe


@app.task(name="beat.tick", bind=True)
def tick(self: Any, entry: str) -> str:
    headers = self.request.headers or {}
    observe("start", entry, id=self.request.id, queue=_queue_of(self), tick=headers.get("durable_beat_tick"),
            missed_from=headers.get("durable_beat_missed_from"), missed_to=headers.get("durable_beat_missed_to"))
    return entry


def _entries() -> dict[str, Any]:
    schedule: dict[str, Any] = {}
    given = os.environ.get("E2E_BEAT", "{}")
    if os.environ.get("E2E_BEAT_FILE"):
        with open(os.environ["E2E_BEAT_FILE"]) as source:  # read anew by a replica SIGHUP restarts
            given = source.read()
    for name, spec in json.loads(given).items():
        if "raw" in spec:
            schedule[name] = spec["raw"]
            continue
        options: dict[str, Any] = {"queue": os.environ.get("E2E_QUEUES", "celery").split(",")[0]}
        if "catch_up" in spec:
            options["durable_catch_up"] = spec["catch_up"]
        schedule[name] = {"task": "beat.tick", "schedule": float(spec["every"]), "args": [name], "options": options}
    return schedule


app.conf.beat_schedule = _entries()
