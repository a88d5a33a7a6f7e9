"""DurableConsumer: Celery's consumer with its push fetch replaced by planned claims."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from time import monotonic
from typing import Any

from celery import bootsteps, signals
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from celery.worker.loops import asynloop

from ..config import DurableConfig
from ..planning.claim_sweep import capacity
from . import metrics_gauges
from .claimer import Claimer
from .drain import Drain
from .process_cap import HeldRuns
from .redis_restore import RedisRestorer

logger = logging.getLogger(__name__)


def _shutdown_requested() -> bool:
    # Set by Celery's signal handlers (to an exit code, which may be 0).
    return worker_state.should_stop is not None or worker_state.should_terminate is not None


class _ClaimingTaskConsumer:
    """Stands in for the task consumer Celery's loop starts: it claims instead of consuming.

    The loop sets ``on_message`` to the task handler and calls ``consume()``
    once the hub is registered; both go to the claimer. The handler is wrapped
    so ``settle(message)`` runs once Celery's strategy has returned.
    """

    def __init__(self, claimer: Claimer, settle: Callable[[Any], None] | None = None) -> None:
        self._claimer = claimer
        self._settle = settle

    @property
    def on_message(self) -> Any:
        return self._claimer.handler

    @on_message.setter
    def on_message(self, handler: Any) -> None:
        settle = self._settle
        if handler is None or settle is None:
            self._claimer.handler = handler
            return

        def on_task_message(message: Any) -> Any:
            try:
                return handler(message)
            finally:
                settle(message)

        self._claimer.handler = on_task_message

    def consume(self) -> None:
        self._claimer.start()


def durable_loop(
    obj: DurableConsumer,
    connection: Any,
    consumer: Any,
    blueprint: Any,
    hub: Any,
    qos: Any,
    heartbeat: Any,
    clock: Any,
    hbrate: float = 2.0,
) -> None:
    """The consumer's loop: Celery's own with a hub, a short polling loop without one."""
    claimer = obj.new_claimer(connection, hub)
    stand_in = _ClaimingTaskConsumer(claimer, obj.settle_dropped)
    try:
        if hub is not None:
            asynloop(obj, connection, stand_in, blueprint, hub, qos, heartbeat, clock, hbrate)
        else:
            _polling_loop(obj, connection, stand_in, blueprint, claimer)
    finally:
        claimer.stop()


def _polling_loop(obj: DurableConsumer, connection: Any, stand_in: Any, blueprint: Any, claimer: Claimer) -> None:
    # Transports without an event loop (the embedded SQLAlchemy broker): the
    # claim passes run here, between short drains that serve the idle wait
    # and remote control.
    stand_in.on_message = obj.create_task_handler()
    stand_in.consume()
    obj.on_ready()
    interval = obj.durable_config.idle_poll_interval
    while blueprint.state == bootsteps.RUN and obj.connection:
        worker_state.maybe_shutdown()
        obj.perform_pending_operations()
        obj.run_scheduled()
        try:
            connection.drain_events(timeout=interval)
        except TimeoutError:
            pass
        except OSError:
            if blueprint.state == bootsteps.RUN:
                raise


class DurableStats(bootsteps.StartStopStep):
    """Adds the claim counts to ``celery inspect stats``."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def info(self, c: Any) -> dict[str, Any]:
        if not isinstance(c, DurableConsumer):
            return {}
        return {"durable": c.durable_stats()}


class DurableConsumer(Consumer):
    """The consumer ``-P durable`` installs: claims planned before each fetch."""

    loop = staticmethod(durable_loop)

    class Blueprint(Consumer.Blueprint):
        default_steps = [
            *Consumer.Blueprint.default_steps,
            "celery_durable.worker.consumer:DurableStats",
            "celery_durable.worker.relay_step:OutboxRelay",
        ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config: DurableConfig = self.controller.durable_config
        self.durable_config = config
        consumed = list(self.app.amqp.queues.consume_from)
        slots = {queue: config.slots_for(queue) for queue in consumed}
        self.durable_capacity = capacity(config.max_in_flight, self.pool.limit, list(slots.values()))
        self.held = HeldRuns(self.durable_capacity, slots, config.max_scheduled)
        #: ETA runs that fell due while the worker was full: admitted first at the next pass.
        self._due: deque[tuple[Any, Callable[[], None]]] = deque()
        self.claimer: Claimer | None = None
        self._scheduled: list[Any] = []
        self.drain = Drain(self)
        self.pool.run_listener = self
        self.pool.drain = self.drain
        signals.task_received.connect(self._on_task_received, sender=self, weak=False)
        signals.task_revoked.connect(self._on_task_revoked, weak=False)
        metrics_gauges.register_worker(self)

    # -- the claimer, one per connection ---------------------------------------
    def new_claimer(self, connection: Any, hub: Any) -> Claimer:
        if self.claimer is not None:
            self.claimer.close()
        config = self.durable_config
        logger.info(
            "durable.worker.capacity capacity=%s max_in_flight=%s pool=%s queue_slots=%s",
            self.durable_capacity, config.max_in_flight, self.pool.limit, self.held.free_slots(),
            extra={"capacity": self.durable_capacity, "max_in_flight": config.max_in_flight},
        )
        if hub is not None:
            schedule = hub.call_soon
        else:
            schedule = self._scheduled.append
        claimer = Claimer(
            connection=connection,
            queues=lambda: list(self.app.amqp.queues.consume_from.values()),
            held=self.held,
            accept=self.app.conf.accept_content,
            schedule=schedule,
            stop_requested=_shutdown_requested,
            before_pass=self.admit_due,
        )
        self.claimer = claimer
        restorer = RedisRestorer.for_connection(connection, self.durable_config.restore_interval)
        timers: list[tuple[float, Callable[[], Any]]] = [(self.durable_config.safety_interval, claimer.kick)]
        if restorer is not None:
            timers.append((restorer.interval, restorer.restore))
            timers.append((restorer.renew_interval, lambda: restorer.renew(self._held_messages())))
        if hub is not None:
            for interval, fn in timers:
                hub.call_repeatedly(interval, fn)
        else:
            self._poll_timers = timers
            self._poll_timer_due = [0.0 for _ in self._poll_timers]
        return claimer

    def _held_messages(self) -> list[Any]:
        """Every message this worker holds: running, waiting for a slot, or waiting for its ETA."""
        return [run.message for run in self.held.snapshot()]

    def run_scheduled(self) -> None:
        """Run kicks queued from other threads (no-hub mode only), then due timers."""
        while self._scheduled:
            self._scheduled.pop(0)()
        now = monotonic()
        for index, (interval, fn) in enumerate(self._poll_timers):
            if now >= self._poll_timer_due[index]:
                self._poll_timer_due[index] = now + interval
                fn()

    # -- ETA runs: counted while they wait, given a slot when due -----------------------
    def apply_eta_task(self, task: Any) -> None:
        self._when_admitted(task, lambda: Consumer.apply_eta_task(self, task))

    def _limit_post_eta(self, request: Any, bucket: Any, tokens: Any) -> None:
        self._when_admitted(request, lambda: Consumer._limit_post_eta(self, request, bucket, tokens))

    def _when_admitted(self, request: Any, go: Callable[[], None]) -> None:
        # Called by Celery's timer (the loop thread with a hub, a timer thread
        # without one) when the ETA passes.
        if self.held.try_admit(request.message):
            go()
        else:
            self._due.append((request, go))

    def admit_due(self) -> None:
        """Start the due runs that now fit, in the order they fell due."""
        waiting = len(self._due)
        for _ in range(waiting):
            request, go = self._due.popleft()
            if self.held.try_admit(request.message):
                go()
            else:
                self._due.append((request, go))

    # -- counting: what the pool and the strategy tell ------------------------------
    def _on_task_received(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        if self.claimer is not None and request is not None:
            self.claimer.bind_request(request)

    def _on_task_revoked(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        # ``request`` is the task's Context, not the worker request (Celery's
        # Request._announce_revoked sends ``request=self._context``). A request
        # revoked before the pool got it (its ETA fired, its rate-limit token
        # came, or it was discarded at execute_using_pool) has no other way
        # back; one the pool has is given back by the pool's callback; one the
        # strategy discarded before binding is given back by the claimer.
        if request is None:
            return
        run = self.held.find_revoked(request)
        if run is not None and not run.in_pool:
            self.run_finished(run.request)

    def settle_dropped(self, message: Any) -> None:
        """Give back the count of a request the strategy settled itself, after binding it.

        Celery's strategy sends ``task_received`` (binding the request to its
        count) before it routes the request; when it then cannot schedule it
        (an ETA that overflows the system time zone) it rejects the message
        and returns: no pool callback and no revoke signal will ever come. A
        request still held once the strategy returned is waiting for its ETA
        or a rate-limit token, or is in the pool; one already acknowledged or
        rejected and not in the pool is finished.
        """
        run = self.held.find(message)
        if run is None or run.request is None or run.in_pool:
            return
        if getattr(run.request, "acknowledged", False):
            self.run_finished(run.request)

    def run_pooled(self, request: Any) -> None:
        run = self.held.find(request.message)
        if run is not None:
            run.in_pool = True

    def run_finished(self, request: Any) -> None:
        if self.held.give_back(request.message) is not None and self.claimer is not None:
            self.claimer.kick()

    def is_handed_back(self, request: Any) -> bool:
        run = self.held.find(request.message)
        return bool(run is not None and run.handed_back)

    # -- queues added or cancelled by remote control ------------------------------
    def add_task_queue(self, queue: str, exchange: Any = None, exchange_type: Any = None,
                       routing_key: Any = None, **options: Any) -> None:
        queues = self.app.amqp.queues
        if queue in queues:
            q = queues.select_add(queues[queue])
        else:
            q = queues.select_add(
                queue,
                exchange=queue if exchange is None else exchange,
                exchange_type="direct" if exchange_type is None else exchange_type,
                routing_key=routing_key,
                **options,
            )
        q(self.connection.default_channel).declare()
        self.held.set_queue(q.name, self.durable_config.slots_for(q.name))
        logger.info("durable.queue.added queue=%s", q.name)
        if self.claimer is not None:
            self.claimer.kick()

    def cancel_task_queue(self, queue: str) -> None:
        queues = self.app.amqp.queues
        queues.deselect(queue)
        logger.info("durable.queue.cancelled queue=%s", queue)

    # -- reconnects ----------------------------------------------------------------
    def _restore_prefetch_count_after_connection_restart(self, p: Any, *args: Any) -> None:
        # Celery (5.7, consumer.py) restores its push consumer's prefetch count after a
        # reconnect from each ack's promise: under thread execution that runs on a pool
        # thread, whose basic.qos then waits on the connection beside the hub thread, and
        # either may swallow the other's reply (the worker hangs for good). -P durable
        # claims and never push-consumes tasks: there is no prefetch count to restore.
        self._maximum_prefetch_restored = True

    # -- shutdown ----------------------------------------------------------------
    def stop(self) -> None:
        if self.claimer is not None:
            self.claimer.stop()
        super().stop()

    def on_close(self) -> None:
        # On a lost connection Celery drops every request the pool does not
        # have yet (ETA-waiting, rate-limited): their messages can no longer be
        # acked and the broker delivers them again. Their counts go with them,
        # or a reconnected worker would stay full of runs that will never end.
        super().on_close()
        self._due.clear()
        for run in self.held.snapshot():
            if not run.in_pool:
                self.held.give_back(run.message)
            elif run.request is not None:
                # The run goes on in the pool, but its message is no longer ours: the
                # broker (RabbitMQ) or kombu's channel close (Redis) has put it back.
                # Its late ack must not be sent: on Redis it reaches a closed channel
                # whose pool is gone and kills the worker (kombu raises AttributeError,
                # not a connection error). The copy is a duplicate the run's lease handles.
                run.request.acknowledged = True

    def durable_stats(self) -> dict[str, Any]:
        config = self.durable_config
        return {
            "in_flight": self.held.held(),
            "scheduled": self.held.scheduled(),
            "max_in_flight": config.max_in_flight,
            "capacity": self.durable_capacity,
            "pool_size": self.pool.limit,
            "held_by_queue": self.held.held_by_queue(),
            "queue_slots": {q: config.slots_for(q) for q in self.held.queues()},
            "claim_passes": self.claimer.passes if self.claimer is not None else 0,
        }
