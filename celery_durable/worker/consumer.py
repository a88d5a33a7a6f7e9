"""DurableConsumer: Celery's consumer with its push fetch replaced by planned claims."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import bootsteps, signals
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from celery.worker.loops import asynloop

from celery_durable.compat.worker_state import shutdown_requested
from celery_durable.config import DurableConfig
from celery_durable.metrics import worker_gauges
from celery_durable.worker.claimer import Claimer
from celery_durable.worker.runtime import WorkerRuntime

logger = logging.getLogger(__name__)


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
    stand_in = _ClaimingTaskConsumer(claimer, obj.runtime.settle_dropped)
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
        obj.runtime.run_scheduled()
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
        return {"durable": c.runtime.stats()}


class DurableConsumer(Consumer):
    """The consumer ``-P durable`` installs: Celery's, with its events forwarded to a :class:`WorkerRuntime`."""

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
        self.runtime = WorkerRuntime(
            config,
            queues=list(self.app.amqp.queues.consume_from),
            pool_limit=self.pool.limit,
            republish_connection=self.app.connection_for_write,
            stop_requested=shutdown_requested,
        )
        # Kept as attributes: the e2e harness and remote control read them.
        self.held = self.runtime.held
        self.durable_capacity = self.runtime.capacity()
        self.drain = self.runtime.drain
        self.pool.run_listener = self.runtime
        self.pool.drain = self.drain
        signals.task_received.connect(self._on_task_received, sender=self, weak=False)
        signals.task_revoked.connect(self._on_task_revoked, weak=False)
        worker_gauges.register_worker(self.runtime, config)

    @property
    def claimer(self) -> Claimer | None:
        return self.runtime.claimer

    def new_claimer(self, connection: Any, hub: Any) -> Claimer:
        claimer = self.runtime.new_claimer(
            connection,
            queues=lambda: list(self.app.amqp.queues.consume_from.values()),
            accept=self.app.conf.accept_content,
            schedule=hub.call_soon if hub is not None else None,
        )
        if hub is not None:
            for interval, fn in self.runtime.timers:
                hub.call_repeatedly(interval, fn)
        return claimer

    # -- ETA runs: counted while they wait, given a slot when due -----------------------
    def apply_eta_task(self, task: Any) -> None:
        self.runtime.when_admitted(task, lambda: Consumer.apply_eta_task(self, task))

    def _limit_post_eta(self, request: Any, bucket: Any, tokens: Any) -> None:
        self.runtime.when_admitted(request, lambda: Consumer._limit_post_eta(self, request, bucket, tokens))

    # -- what the strategy and the revoke signal tell ------------------------------
    def _on_task_received(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        if request is not None:
            self.runtime.request_made(request)

    def _on_task_revoked(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        # ``request`` is the task's Context, not the worker request (Celery's
        # Request._announce_revoked sends ``request=self._context``).
        if request is not None:
            self.runtime.request_revoked(request)

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
        self.runtime.add_queue(q.name)

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
        self.runtime.stop()
        super().stop()

    def on_close(self) -> None:
        # On a lost connection Celery drops every request the pool does not have yet.
        super().on_close()
        self.runtime.connection_lost()

    def shutdown(self) -> None:
        # A stopped worker leaves the gauges, and its signal receivers go with it
        # (connected with weak=False, they would keep it alive and called).
        try:
            super().shutdown()
        finally:
            signals.task_received.disconnect(self._on_task_received, sender=self)
            signals.task_revoked.disconnect(self._on_task_revoked)
            worker_gauges.unregister_worker(self.runtime)

    def durable_stats(self) -> dict[str, Any]:
        return self.runtime.stats()
