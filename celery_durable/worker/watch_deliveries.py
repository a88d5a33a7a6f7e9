"""The queue watch's side of the claim loop (RabbitMQ): which queues it watches, and what each pushed message does.

worker/queue_watch.py speaks to the broker (the watch channel, its one credit, the placeholder);
planning/watch_turn.py says whether a pushed message has the turn. This module sits between them and
the claimer: it hands the watch the queues a pass proved empty, and decides each message the watch is
pushed — it runs, or it goes back in place — but never while a claim pass or an admission is on the
stack (``ClaimDepth``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from celery_durable.compat.amqp_watch import accepts_global_qos
from celery_durable.compat.host_types import HostMessage
from celery_durable.planning.watch_turn import runs_now
from celery_durable.worker.held_runs import HeldRuns
from celery_durable.worker.probing import QueueProber
from celery_durable.worker.queue_watch import QueueWatch


class ClaimDepth:
    """How many claim passes and admissions are on the stack now (``with depth:`` around each).

    Any synchronous read of the connection dispatches the watch's deliveries: a pass's gets, the idle
    wait's cancel, a strategy's confirm. Decided inside a pass, a delivery would spend room the pass
    already planned; decided inside an admission, it would admit a run while the outer one's request
    is not yet bound. A plain class, not a generator context manager: it wraps every pass.
    """

    __slots__ = ("level",)

    def __init__(self) -> None:
        self.level = 0

    def __enter__(self) -> None:
        self.level += 1

    def __exit__(self, *exc_info: object) -> None:
        self.level -= 1


class WatchHost(Protocol):
    """What a watch decision reads and does on the claimer (worker/claimer.py)."""

    cursor: str | None
    held: HeldRuns

    @property
    def claiming(self) -> bool:
        """Running, and no stop asked for."""

    @property
    def admitting(self) -> bool:
        """Claiming, with Celery's task handler bound."""

    def consumed_order(self) -> tuple[dict[str, Any], Sequence[str]]:
        """The consumed queues by name, and the held queues' order among them."""

    def admit_bounded(self, queue_name: str, message: HostMessage) -> int:
        """Admit one message within the room and its queue's slots; 1 if it now holds a slot."""

    def kick(self) -> None:
        """A pass soon."""

    def kick_after_next_poll(self) -> None:
        """A pass once the hub has polled again."""


class WatchDeliveries:
    """Feeds the queue watch the queues proven empty, and decides what it is pushed, in order, at depth 0."""

    def __init__(self, host: WatchHost, watch: QueueWatch, prober: QueueProber, depth: ClaimDepth) -> None:
        self._host = host
        self.watch = watch
        self._prober = prober
        self._depth = depth
        #: Deliveries read while something was on the stack, decided once it is empty.
        self._pending: deque[tuple[str, HostMessage]] = deque()
        #: Queues the watch may not consume (quorum, stream: no global qos), by name.
        self._unwatchable: set[str] = set()
        self.claimed = 0
        self.given_back = 0

    def forget(self) -> None:
        """The consumed queues changed: nothing is watched, and every queue is judged afresh."""
        self.watch.unwatch_all()
        self._unwatchable.clear()

    def watch_proven_empty(self, queues: Mapping[str, Any]) -> None:
        """Watch the consumed queues this pass proved empty, but the ones that refuse a global qos."""
        new = self._prober.proven_empty() - self.watch.watched()
        if not new:
            return
        for name in new:
            queue = queues.get(name)
            if queue is not None and not accepts_global_qos(queue.queue_arguments):
                self._unwatchable.add(name)
        watchable = [name for name in new if name in queues and name not in self._unwatchable]
        if watchable:  # a worker of quorum queues alone opens no watch channel
            self.watch.watch(watchable)

    def delivered(self, queue_name: str, message: HostMessage) -> None:
        """The watch was pushed ``message``: decided now, or when no pass or admission is on the stack."""
        self._pending.append((queue_name, message))
        self.decide_waiting()

    def decide_waiting(self) -> None:
        """Decide the deliveries read meanwhile, in the order they came, if nothing else is deciding."""
        if self._depth.level or not self._pending:
            return
        with self._depth:
            while self._pending:
                self._decide(*self._pending.popleft())

    def _decide(self, queue_name: str, message: HostMessage) -> None:
        """Run a pushed message if the turn would have given it the slot (planning/watch_turn.py), else give it back.

        Given back, it goes back in place with ``redelivered`` set (RabbitMQ sets it on every requeued
        message); Celery copies it into the request's ``delivery_info``, and acts on it only under
        ``worker_deduplicate_successful_tasks`` with late acks: one result-backend lookup, and the run goes
        on (it never ran). Stock Celery sets the same flag on the prefetched messages a stopping worker
        hands back. Either way the passes ask its queue in turn from now on.
        """
        host, prober = self._host, self._prober
        prober.delivered(queue_name)
        _, order = host.consumed_order()
        if host.admitting and runs_now(queue_name, order, host.cursor, prober.holding_work(),
                                       host.held.free_slots(), host.held.room()):
            host.cursor = queue_name
            self.claimed += host.admit_bounded(queue_name, message)
            self.watch.decided(message)
            # The rest of the room, and the queue the push came from, go to a pass after the hub's next
            # poll (as the idle wait's delivery: the pool writes the job just admitted on that poll).
            host.kick_after_next_poll()
            return
        self.given_back += 1
        self.watch.give_back(message)
        if host.claiming:
            host.kick()

