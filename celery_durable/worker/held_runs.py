"""The runs one worker holds, per queue: taken at claim, handed back exactly once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from celery_durable.compat.host_types import HostMessage, HostRequest
from celery_durable.compat.request import acks_late, cached_context
from celery_durable.errors import InvariantBroken


@dataclass
class HeldRun:
    """One claimed message and, once the strategy made one, its request."""

    queue: str
    message: HostMessage
    request: HostRequest | None = None
    #: Set at the drain deadline: the message went back to the broker, so the
    #: pool's late callbacks for it must not ack it or record a failure.
    handed_back: bool = False
    #: Set when the pool is given the request: from then on the pool's
    #: callback gives the count back, whatever else happens to the request.
    in_pool: bool = False
    #: Waiting for its ETA/countdown: counted, but holding no slot until it
    #: is due (a durable sleep or a long countdown must not fill the worker).
    scheduled: bool = False
    #: The fleet-limit leases the run took before it was admitted (limits/gate.py), if any.
    limit_grant: Any = None
    #: The gate has looked at it (at claim, or when its ETA fell due): it is not asked twice.
    limit_checked: bool = False


class HeldRuns:
    """Counts runs held by this worker, across every path a claimed message takes.

    A run is taken when its message is claimed and given back exactly once:
    when the pool reports it finished, when it is revoked or rejected, or when
    the strategy dropped its message without making a request. Pool callbacks
    arrive on other threads (thread pool, prefork without an event loop), so
    every method takes the lock.
    """

    def __init__(self, capacity: int, queue_slots: Mapping[str, int], max_scheduled: int = 1000) -> None:
        if capacity < 1:
            raise InvariantBroken(f"capacity must be >= 1, got {capacity!r}")
        if max_scheduled < 1:
            raise InvariantBroken(f"max_scheduled must be >= 1, got {max_scheduled!r}")
        self.capacity = capacity
        self.max_scheduled = max_scheduled
        self._slots = dict(queue_slots)
        self._runs: dict[int, HeldRun] = {}
        #: Slot-holding runs per queue; scheduled runs are counted apart.
        self._by_queue: dict[str, int] = {queue: 0 for queue in queue_slots}
        #: Free slots per queue, kept as runs come and go: a claim pass reads them whole, and
        #: recounting them from the two dicts above cost a 200-queue pass ~30 us each time.
        self._free: dict[str, int] = {queue: max(slots, 0) for queue, slots in queue_slots.items()}
        self._holding = 0
        self._scheduled = 0
        self._lock = threading.Lock()
        #: Called with each run whose count was given back, outside the lock (the gate gives its leases back).
        self.on_given_back: Callable[[HeldRun], None] | None = None

    def set_capacity(self, capacity: int) -> None:
        # 0 is a pool shrunk to nothing by remote control: claim nothing until it grows.
        if capacity < 0:
            raise InvariantBroken(f"capacity must be >= 0, got {capacity!r}")
        with self._lock:
            self.capacity = capacity

    # -- the queues --------------------------------------------------------
    def set_queue(self, queue: str, slots: int) -> None:
        with self._lock:
            self._slots[queue] = slots
            self._by_queue.setdefault(queue, 0)
            self._recount(queue)

    def queues(self) -> tuple[str, ...]:
        return tuple(self._slots)

    # -- counting ------------------------------------------------------------
    def take(self, queue: str, message: HostMessage) -> HeldRun:
        run = HeldRun(queue=queue, message=message)
        with self._lock:
            if id(message) in self._runs:
                raise InvariantBroken(f"message {message!r} is already held")
            self._runs[id(message)] = run
            self._by_queue[queue] = self._by_queue.get(queue, 0) + 1
            self._holding += 1
            self._recount(queue)
        return run

    def schedule(self, message: HostMessage) -> bool:
        """``message``'s run waits for its ETA: it keeps its count but frees its slot."""
        with self._lock:
            run = self._runs.get(id(message))
            if run is None or run.scheduled or run.in_pool:
                return False
            run.scheduled = True
            self._by_queue[run.queue] -= 1
            self._holding -= 1
            self._scheduled += 1
            self._recount(run.queue)
            return True

    def try_admit(self, message: HostMessage) -> bool:
        """A scheduled run fell due: take a slot for it if the cap and its queue have one."""
        with self._lock:
            run = self._runs.get(id(message))
            if run is None or not run.scheduled:
                return True
            if self._holding >= self.capacity:
                return False
            if self._by_queue.get(run.queue, 0) >= self._slots.get(run.queue, 0):
                return False
            run.scheduled = False
            self._by_queue[run.queue] += 1
            self._holding += 1
            self._scheduled -= 1
            self._recount(run.queue)
            return True

    def find(self, message: HostMessage) -> HeldRun | None:
        with self._lock:
            return self._runs.get(id(message))

    def find_revoked(self, context: Any) -> HeldRun | None:
        """The held run a ``task_revoked`` signal is about, or None.

        Celery sends that signal with the task's ``Context`` (the worker
        request's cached ``_context``), not the worker request. The run whose
        request cached that very Context is the one; failing that (a Celery
        that stops caching it), the one bound run with that task id that
        never reached the pool.
        """
        with self._lock:
            bound = [run for run in self._runs.values() if run.request is not None]
        for run in bound:
            if cached_context(run.request) is context:
                return run
        task_id = getattr(context, "id", None)
        candidates = [run for run in bound
                      if not run.in_pool and task_id is not None and getattr(run.request, "id", None) == task_id]
        return candidates[0] if len(candidates) == 1 else None

    def give_back(self, message: HostMessage) -> HeldRun | None:
        """Return the count of ``message``'s run; None if it was already returned."""
        with self._lock:
            run = self._runs.pop(id(message), None)
            if run is None:
                return None
            if run.scheduled:
                self._scheduled -= 1
            else:
                self._by_queue[run.queue] -= 1
                self._holding -= 1
                self._recount(run.queue)
        if self.on_given_back is not None:
            self.on_given_back(run)
        return run

    def held(self) -> int:
        """Runs holding a slot: running, or handed to the pool, or due."""
        return self._holding

    def scheduled(self) -> int:
        """Runs waiting for their ETA (counted, holding no slot)."""
        return self._scheduled

    def total(self) -> int:
        return len(self._runs)

    def held_by_queue(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_queue)

    def room(self) -> int:
        if self._scheduled >= self.max_scheduled:
            # Too many ETA runs held already: claim nothing more until some fall due.
            return 0
        return max(self.capacity - self._holding, 0)

    def holds(self, message: HostMessage) -> bool:
        """Whether ``message``'s run is held and holds a slot (not waiting for its ETA)."""
        with self._lock:
            run = self._runs.get(id(message))
        return run is not None and not run.scheduled

    def acked_as_it_ends(self, message: HostMessage) -> bool:
        """Whether an ack of ``message`` now is its run's late ack: in the pool, a task that acks late."""
        with self._lock:
            run = self._runs.get(id(message))
        return run is not None and run.in_pool and run.request is not None and acks_late(run.request)

    def room_for(self, queue: str) -> int:
        """The runs ``queue`` may still start: its free slots, within the process's room."""
        return min(self.room(), self._free.get(queue, 0))

    def free_slots(self) -> dict[str, int]:
        with self._lock:
            return dict(self._free)

    def _recount(self, queue: str) -> None:
        # Called with the lock held, after ``queue``'s count or slots changed.
        slots = self._slots.get(queue)
        if slots is not None:
            self._free[queue] = max(slots - self._by_queue.get(queue, 0), 0)

    def snapshot(self) -> list[HeldRun]:
        with self._lock:
            return list(self._runs.values())

    def give_back_all(self, runs: Iterable[HeldRun]) -> None:
        for run in runs:
            self.give_back(run.message)
