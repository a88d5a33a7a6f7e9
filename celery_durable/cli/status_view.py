"""Pure: the fleet's state in one snapshot, and that snapshot as one terminal screen or one JSON document.

``cli/status.py`` reads the snapshot (workers over remote control, queues from
the broker, runs and the outbox from the store); this module only shapes it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class WorkerView:
    name: str
    in_flight: int
    capacity: int
    held_by_queue: dict[str, int]
    queue_slots: dict[str, int]
    #: The port the node serves its metrics on, None when it serves none.
    metrics_port: int | None = None


@dataclass(frozen=True)
class QueueView:
    name: str
    #: None: the broker has no such queue (RabbitMQ), or could not be read.
    depth: int | None
    #: None: empty is 0; unknown (no send stamp, a head the broker does not show) is None.
    oldest_ready_seconds: float | None
    dead_runs: int


@dataclass
class FleetSnapshot:
    workers: list[WorkerView] = field(default_factory=list)
    queues: list[QueueView] = field(default_factory=list)
    runs_by_state: dict[str, int] = field(default_factory=dict)
    outbox_backlog: int | None = None
    outbox_oldest_seconds: float | None = None
    #: The store could not be read: no runs, outbox or dead-run counts to show (its problem line says why).
    store_unread: bool = False
    #: What could not be read (the broker, the store), one line each: the rest is still shown.
    problems: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


#: Characters a queue's name takes in the QUEUES table (a longer one pushes its row's columns right).
QUEUE_NAME_WIDTH = 30


def render(snapshot: FleetSnapshot) -> str:
    """One screen: workers, queues, runs by state, outbox, and what could not be read."""
    lines: list[str] = []
    total_in_flight = sum(w.in_flight for w in snapshot.workers)
    total_capacity = sum(w.capacity for w in snapshot.workers)
    lines.append(f"WORKERS  {len(snapshot.workers)} answering, {total_in_flight}/{total_capacity} in flight")
    for worker in snapshot.workers:
        held = ", ".join(f"{queue} {worker.held_by_queue.get(queue, 0)}/{slots}"
                         for queue, slots in sorted(worker.queue_slots.items()))
        metrics = f"  metrics :{worker.metrics_port}" if worker.metrics_port is not None else ""
        lines.append(f"  {worker.name:<40} {worker.in_flight:>4}/{worker.capacity:<4} {held}{metrics}")
    if not snapshot.workers:
        lines.append("  (no -P durable worker answered)")
    lines.append("")
    # The header's columns over the rows' (a row: two spaces and a 30-wide name before its depth).
    lines.append(f"{'QUEUES':<{QUEUE_NAME_WIDTH + 2}} {'depth':>8} {'oldest ready':>14} {'dead runs':>10}")
    for queue in snapshot.queues:
        depth = "-" if queue.depth is None else str(queue.depth)
        dead = "-" if snapshot.store_unread else str(queue.dead_runs)
        lines.append(f"  {queue.name:<{QUEUE_NAME_WIDTH}} {depth:>8} {_age(queue.oldest_ready_seconds):>14} {dead:>10}")
    if not snapshot.queues:
        lines.append("  (no queue to show: no worker answered)")
    lines.append("")
    if not snapshot.store_unread:  # else its "!" line is all there is to say about runs and the outbox
        states = "  ".join(f"{state} {count}" for state, count in sorted(snapshot.runs_by_state.items()))
        lines.append(f"RUNS     {states or 'none'}")
    if snapshot.outbox_backlog is not None:
        lines.append(f"OUTBOX   {snapshot.outbox_backlog} unpublished, oldest {_age(snapshot.outbox_oldest_seconds)}")
    for problem in snapshot.problems:
        lines.append(f"! {problem}")
    return "\n".join(lines)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"
