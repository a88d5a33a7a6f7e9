"""Pure: the dashboard's last minutes, one sample per snapshot, as series its charts draw."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from celery_durable.cli.status_view import FleetSnapshot


@dataclass(frozen=True)
class Sample:
    at: float
    #: worker name -> (in flight, capacity)
    workers: dict[str, tuple[int, int]]
    #: queue name -> (depth, oldest ready seconds); None where the broker could not say
    queues: dict[str, tuple[int | None, float | None]]


class History:
    """Samples of the last ``window`` seconds; older ones fall off as new ones come."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._samples: deque[Sample] = deque()

    def add(self, at: float, snapshot: FleetSnapshot) -> None:
        self._samples.append(Sample(
            at,
            {w.name: (w.in_flight, w.capacity) for w in snapshot.workers},
            {q.name: (q.depth, q.oldest_ready_seconds) for q in snapshot.queues},
        ))
        while self._samples and self._samples[0].at < at - self.window:
            self._samples.popleft()

    def series(self) -> dict[str, Any]:
        """``{"t": [...], "workers": {name: {"in_flight": [...], "capacity": [...]}}, "queues": {name:
        {"depth": [...], "oldest": [...]}}}``, every list aligned with ``t`` (null where a sample lacks it)."""
        samples = list(self._samples)
        worker_names = sorted({name for s in samples for name in s.workers})
        queue_names = sorted({name for s in samples for name in s.queues})
        workers = {name: {"in_flight": [s.workers[name][0] if name in s.workers else None for s in samples],
                          "capacity": [s.workers[name][1] if name in s.workers else None for s in samples]}
                   for name in worker_names}
        queues = {name: {"depth": [s.queues[name][0] if name in s.queues else None for s in samples],
                         "oldest": [s.queues[name][1] if name in s.queues else None for s in samples]}
                  for name in queue_names}
        return {"t": [s.at for s in samples], "workers": workers, "queues": queues}
