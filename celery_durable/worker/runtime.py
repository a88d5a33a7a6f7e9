"""WorkerRuntime: the claim loop's state — held runs, due ETA runs, the claimer, its timers, the drain.

A plain object: it takes its config, its clock and how it fetches in its
constructor, and knows nothing of Celery's consumer. ``DurableConsumer`` is
the thin adapter Celery calls; it forwards each host event (a request made, a
run pooled or finished, a revoke, a lost connection) here. So the rules that
keep the count exact run in unit tests on kombu's in-memory transport.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from celery_durable.clock import SYSTEM_CLOCK, Clock
from celery_durable.compat.host_types import HostMessage, HostRequest
from celery_durable.compat.request import skip_ack, was_acknowledged
from celery_durable.config import DurableConfig
from celery_durable.limits.fleet import FleetLimits
from celery_durable.limits.gate import LimitGate
from celery_durable.metrics.registry import served_port
from celery_durable.planning.capacity import capacity
from celery_durable.worker.claim_stats import ClaimStats
from celery_durable.worker.claimer import Claimer
from celery_durable.worker.drain import Drain
from celery_durable.worker.fetchers import Fetcher, fetcher_for
from celery_durable.worker.held_runs import HeldRun, HeldRuns
from celery_durable.worker.redis_restore import RedisRestorer

logger = logging.getLogger(__name__)

#: A callable and how often (seconds) the loop calls it.
Timer = tuple[float, Callable[[], Any]]


class WorkerRuntime:
    """One ``-P durable`` worker's claim state; every count taken is given back exactly once."""

    def __init__(
        self,
        config: DurableConfig,
        *,
        queues: Sequence[str],
        pool_limit: int,
        republish_connection: Callable[[], Any],
        clock: Clock = SYSTEM_CLOCK,
        stop_requested: Callable[[], bool] = lambda: False,
        new_fetcher: Callable[..., Fetcher] = fetcher_for,
        limits: FleetLimits | None = None,
    ) -> None:
        self.config = config
        #: Fleet limits (limits/), started before the first claim and stopped by :meth:`close_limits`;
        #: None when no task this worker knows declares one. The claimer and the count use the gate.
        self.limits = limits
        self.gate: LimitGate | None = limits.gate if limits is not None else None
        unconsumed = config.unconsumed_queues(queues)
        if unconsumed:
            # Logged here, not at worker_init: Celery sets its logging up after that signal.
            logger.info("durable.config.queue_not_consumed queues=%s: durable_queue_concurrency names queues "
                        "this worker does not consume (-Q); their slots apply if add_consumer adds them",
                        ",".join(unconsumed),
                        extra={"event": "durable.config.queue_not_consumed", "queues": unconsumed})
        slots = {queue: config.slots_for(queue) for queue in queues}
        self._capacity = capacity(config.max_in_flight, pool_limit, list(slots.values()))
        self.pool_limit = pool_limit
        self.held = HeldRuns(self._capacity, slots, config.max_scheduled)
        self.held.on_given_back = self._given_back
        self.drain = Drain(self.held, config, republish_connection, clock=clock)
        self.claimer: Claimer | None = None
        #: This worker's name as a holder of broker messages (Redis: its heartbeat and held set).
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self._restorer: RedisRestorer | None = None
        #: The timers of the current claimer; the adapter puts them on Celery's hub when it has one.
        self.timers: list[Timer] = []
        self._clock = clock
        self._stop_requested = stop_requested
        self._new_fetcher = new_fetcher
        #: ETA runs that fell due while the worker was full: admitted first at the next pass.
        self._due: deque[tuple[Any, Callable[[], None]]] = deque()
        #: Without a hub: kicks queued from any thread, and when each timer is next due.
        self._scheduled: list[Callable[[], None]] = []
        self._timer_due: list[float] = []

    # -- the gauges' view (metrics.worker_gauges.LiveWorker) -------------------------------
    def in_flight(self) -> int:
        return self.held.held()

    def capacity(self) -> int:
        return self._capacity

    # -- the claimer, one per connection ---------------------------------------
    def new_claimer(
        self,
        connection: Any,
        *,
        queues: Callable[[], Sequence[Any]],
        accept: Any,
        schedule: Callable[[Callable[[], None]], None] | None = None,
        hub: Any = None,
        push: bool = False,
    ) -> Claimer:
        """A claimer for ``connection`` (closing the last one), and its timers in ``self.timers``.

        ``schedule`` runs a callable soon on the loop thread (Celery's
        ``LoopKicks``, a self-pipe the hub polls); without one, kicks wait for :meth:`run_scheduled`.
        ``hub`` (Celery's event loop; None without one) polls the Redis idle wait's sockets.
        ``push``: RabbitMQ may push a worker's one open queue (worker/push_consumer.py).
        """
        if self.claimer is not None:
            self.claimer.close()
        if self.limits is not None:
            self.limits.start()
        restorer = RedisRestorer.for_connection(connection, self.config.restore_interval, self.holder,
                                                self.config.lease_ttl)
        self._restorer = restorer
        new_fetcher = self._new_fetcher
        if restorer is not None:
            # Alive before the first claim: a claim recorded under a holder nobody knows could never be
            # found dead, and would wait out kombu's visibility timeout instead.
            restorer.beat()
            new_fetcher = functools.partial(self._new_fetcher, held_key=restorer.held_key)
        queue_slots = self.held.free_slots()
        logger.info(
            "durable.worker.capacity capacity=%s max_in_flight=%s pool=%s queue_slots=%s",
            self._capacity, self.config.max_in_flight, self.pool_limit, queue_slots,
            extra={"event": "durable.worker.capacity", "capacity": self._capacity,
                   "max_in_flight": self.config.max_in_flight, "pool": self.pool_limit,
                   "queue_slots": queue_slots},
        )
        claimer = Claimer(
            connection=connection,
            queues=queues,
            held=self.held,
            accept=accept,
            schedule=schedule if schedule is not None else self._schedule_waking(connection),
            clock=self._clock,
            stop_requested=self._stop_requested,
            before_pass=self.admit_due,
            new_fetcher=new_fetcher,
            gate=self.gate,
            hub=hub,
            push=push,
        )
        self.claimer = claimer
        timers: list[Timer] = [(self.config.safety_interval, claimer.kick)]
        if restorer is not None:
            timers.append((restorer.beat_interval, restorer.beat))
            timers.append((restorer.interval, restorer.restore))
            timers.append((restorer.renew_interval, lambda: restorer.renew(self.held_messages())))
        self.timers = timers
        self._timer_due = [0.0 for _ in timers]
        return claimer

    def kick(self) -> None:
        if self.claimer is not None:
            self.claimer.kick()

    def _schedule_waking(self, connection: Any) -> Callable[[Callable[[], None]], None]:
        """Without a hub: queue ``fn`` for :meth:`run_scheduled`, and end the transport's wait if it can
        be ended (the PostgreSQL broker's ``wake``: its drain waits on LISTEN, not a short sleep)."""
        wake = getattr(getattr(connection, "transport", None), "wake", None)
        if wake is None:
            return self._scheduled.append

        def schedule(fn: Callable[[], None]) -> None:
            self._scheduled.append(fn)
            wake()

        return schedule

    def run_scheduled(self) -> None:
        """Without a hub: run the kicks queued from other threads, then the timers that are due."""
        while self._scheduled:
            self._scheduled.pop(0)()
        now = self._clock.monotonic()
        for index, (interval, fn) in enumerate(self.timers):
            if now >= self._timer_due[index]:
                self._timer_due[index] = now + interval
                fn()

    def held_messages(self) -> list[Any]:
        """Every message this worker holds: running, waiting for a slot, or waiting for its ETA."""
        return [run.message for run in self.held.snapshot()]

    # -- ETA runs: counted while they wait, given a slot when due -----------------------
    def when_admitted(self, request: HostRequest, go: Callable[[], None]) -> None:
        """Start ``request`` (``go``) when it fits; called when its ETA passes."""
        if self._handed_back(request) or not self._within_limits_when_due(request):
            return
        if not self._due and self.held.try_admit(request.message):
            go()
        else:
            # Behind the runs that fell due before it, in order: the next pass starts them
            # (one is asked for if a slot is free now; else the next finished run asks).
            self._due.append((request, go))
            if self.held.room() > 0:
                self.kick()

    def admit_due(self) -> None:
        """Start the due runs that now fit, in the order they fell due (before any new claim)."""
        for _ in range(len(self._due)):
            request, go = self._due.popleft()
            if self._handed_back(request):
                continue
            if self.held.try_admit(request.message):
                go()
            else:
                self._due.append((request, go))

    def _within_limits_when_due(self, request: HostRequest) -> bool:
        """An ETA run takes its fleet-limit leases when due; False if it was parked or dropped instead."""
        run = self.held.find(request.message)
        if self.gate is None or run is None or run.limit_checked:
            return True
        run.limit_checked = True
        (admission,), _ = self.gate.admit_or_hand_back([(run.queue, request.message)])
        if admission is None:
            return True
        if not admission.runs:
            self.held.give_back(request.message)
            return False
        run.limit_grant = admission.grant
        return True

    def _given_back(self, run: HeldRun) -> None:
        # Every path that ends a held run comes here once: its leases go back with its count.
        if run.limit_grant is not None and self.gate is not None:
            self.gate.release(run.limit_grant, started=run.in_pool)

    def _handed_back(self, request: HostRequest) -> bool:
        """The drain gave the message back to the broker: starting the run here would run it twice."""
        run = self.held.find(request.message)
        return run is not None and run.handed_back

    # -- counting: what the strategy, the pool and the revoke signal tell -----------------
    def request_made(self, request: HostRequest) -> None:
        """Celery's strategy made ``request`` for the message being admitted."""
        if self.claimer is not None:
            self.claimer.bind_request(request)

    def request_revoked(self, context: Any) -> None:
        """A revoke of the task whose Context is ``context``.

        A request revoked before the pool got it (its ETA fired, its rate-limit
        token came, or it was discarded before the pool) has no other way back;
        one the pool has is given back by the pool's callback; one the strategy
        discarded before binding is given back by the claimer.
        """
        run = self.held.find_revoked(context)
        if run is not None and run.request is not None and not run.in_pool:
            self.run_finished(run.request)

    def settle_dropped(self, message: HostMessage) -> None:
        """Give back the count of a request the strategy settled itself, after binding it.

        Celery's strategy makes the request (binding it to its count) before it
        routes it; when it then cannot schedule it (an ETA that overflows the
        system time zone) it rejects the message and returns: no pool callback
        and no revoke will ever come. A request still held once the strategy
        returned is waiting for its ETA or a rate-limit token, or is in the
        pool; one already acknowledged or rejected and not in the pool is done.
        """
        run = self.held.find(message)
        if run is None or run.request is None or run.in_pool:
            return
        if was_acknowledged(run.request):
            self.run_finished(run.request)

    def run_pooled(self, request: HostRequest) -> None:
        run = self.held.find(request.message)
        if run is not None:
            run.in_pool = True

    def run_finished(self, request: HostRequest) -> None:
        if self.held.give_back(request.message) is not None:
            self.kick()

    def is_handed_back(self, request: HostRequest) -> bool:
        run = self.held.find(request.message)
        return bool(run is not None and run.handed_back)

    # -- queues, connection, shutdown ------------------------------------------------
    def add_queue(self, queue: str) -> None:
        self.held.set_queue(queue, self.config.slots_for(queue))
        # The queues' slots may have been what bounded the capacity: an added queue raises it.
        self._recompute_capacity()
        logger.info("durable.queue.added queue=%s", queue, extra={"event": "durable.queue.added", "queue": queue})
        self.kick()

    def queue_cancelled(self, queue: str) -> None:
        """``cancel_consumer``: nothing more is claimed from ``queue``; runs held from it go on."""
        if self.claimer is not None:
            self.claimer.queues_changed()
        logger.info("durable.queue.cancelled queue=%s", queue,
                    extra={"event": "durable.queue.cancelled", "queue": queue})

    def pool_resized(self, pool_size: int) -> None:
        """The pool grew or shrank (``pool_grow``/``pool_shrink``): the capacity follows it.

        After a shrink the worker may hold more runs than the new capacity (they
        were running): it claims nothing until they are fewer, so no claimed
        run ever waits for a process.
        """
        self.pool_limit = pool_size
        self._recompute_capacity()
        logger.info("durable.pool.resized pool=%s capacity=%s", pool_size, self._capacity,
                    extra={"event": "durable.pool.resized", "pool": pool_size, "capacity": self._capacity})
        self.kick()

    def _recompute_capacity(self) -> None:
        slots = [self.config.slots_for(name) for name in self.held.queues()]
        self._capacity = capacity(self.config.max_in_flight, self.pool_limit, slots)
        self.held.set_capacity(self._capacity)

    def connection_lost(self) -> None:
        """The broker connection is gone: every held message is the broker's again.

        Runs not in the pool yet (ETA-waiting, rate-limited) are dropped by
        Celery and delivered again, so their counts go (or a reconnected worker
        would stay full of runs that never end). Runs in the pool go on, but
        their late ack must not be sent: on Redis it reaches a closed channel
        whose pool is gone and kills the worker (kombu raises AttributeError,
        not a connection error). Their copy is a duplicate the run's lease handles.
        """
        self._due.clear()
        for run in self.held.snapshot():
            if not run.in_pool:
                self.held.give_back(run.message)
            elif run.request is not None:
                skip_ack(run.request)

    def stop(self) -> None:
        if self.claimer is not None:
            self.claimer.stop()

    def leave_broker(self) -> None:
        """The worker is leaving: on Redis, what it still holds is any live worker's to restore at once."""
        if self._restorer is not None:
            self._restorer.leave()

    def close_limits(self) -> None:
        """The worker is leaving: stop publishing parked messages, give back every lease still held."""
        if self.limits is not None:
            self.limits.stop()

    def stats(self) -> dict[str, Any]:
        """The ``durable`` section of ``celery inspect stats``."""
        config = self.config
        claims = self.claimer.stats() if self.claimer is not None else ClaimStats()
        return {
            "in_flight": self.held.held(),
            "scheduled": self.held.scheduled(),
            "max_in_flight": config.max_in_flight,
            "capacity": self._capacity,
            "pool_size": self.pool_limit,
            "held_by_queue": self.held.held_by_queue(),
            "queue_slots": {q: config.slots_for(q) for q in self.held.queues()},
            **claims.inspect_fields(),
            # Fleet limits: the leases this worker holds (task -> key, "*" for durable_concurrency -> runs),
            # and the messages its gate parked to wait their turn or dropped as busy.
            "leases": self.gate.held() if self.gate is not None else {},
            "limits_waited": self.gate.waited if self.gate is not None else 0,
            "limits_dropped": self.gate.dropped if self.gate is not None else 0,
            # The port this node took from durable_metrics_port (a range gives each node its own): None if none.
            "metrics_port": served_port(),
        }
