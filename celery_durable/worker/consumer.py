"""DurableConsumer: Celery's consumer with its push fetch replaced by planned claims (a thin adapter)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import bootsteps
from celery.worker.consumer import Consumer

from celery_durable.compat.consumer import ConsumerHooks, claiming_loop, consumer_blueprint
from celery_durable.compat.host_types import HostMessage, HostRequest
from celery_durable.compat.worker_state import shutdown_requested
from celery_durable.limits.fleet import FleetLimits
from celery_durable.metrics import queues as queue_metrics
from celery_durable.metrics import worker_gauges
from celery_durable.store.engine import resolve_url
from celery_durable.worker.claimer import Claimer
from celery_durable.worker.loop_kicks import LoopKicks
from celery_durable.worker.runtime import WorkerRuntime
from celery_durable.worker.signals import connect_consumer, disconnect_consumer
from celery_durable.worker.wiring import wiring_for


class DurableStats(bootsteps.StartStopStep):
    """Adds the claim counts to ``celery inspect stats``."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def info(self, c: Any) -> dict[str, Any]:
        if not isinstance(c, DurableConsumer):
            return {}
        # After Celery's Tasks step, whose prefetch_count is the unused push
        # consumer's QoS: the most this worker holds to run at once is its
        # capacity (as stock's prefetch count is under acks_late and a multiplier of 1).
        return {"durable": c.runtime.stats(), "prefetch_count": c.runtime.capacity()}


class DurableConsumer(ConsumerHooks):
    """The consumer ``-P durable`` installs: Celery's, with its events forwarded to a :class:`WorkerRuntime`."""

    loop = staticmethod(claiming_loop)

    Blueprint = consumer_blueprint(
        "celery_durable.worker.consumer:DurableStats",
        "celery_durable.worker.relay_step:OutboxRelay",
        "celery_durable.worker.recovery_step:RunRecovery",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        wiring = wiring_for(self.controller)
        config = wiring.durable_config
        self.durable_config = config
        self.runtime = WorkerRuntime(
            config,
            queues=list(self.app.amqp.queues.consume_from),
            pool_limit=self.pool.limit,
            republish_connection=self.app.connection_for_write,
            stop_requested=shutdown_requested,
            limits=FleetLimits.for_worker(self.app, config, wiring.limits),
        )
        self._kicks: LoopKicks | None = None
        #: Set by a stop (warm shutdown, or a remote-control consumer restart): Celery closes the blueprint
        #: then too, but the connection stays open for the runs still in the pool to be acked.
        self._stopping = False
        self.pool.run_listener = self.runtime
        self.pool.drain = self.runtime.drain
        connect_consumer(self, self._on_task_received, self._on_task_revoked)
        worker_gauges.register_worker(self.runtime, config)
        self._queue_watch = queue_metrics.watch(self.app, lambda: list(self.app.amqp.queues.consume_from.values()),
                                                resolve_url(config.database_url))

    def _loop_kicks(self, hub: Any) -> LoopKicks | None:
        # One per connection: Celery resets its hub (forgetting every fd) when it reconnects.
        if self._kicks is not None:
            self._kicks.close()
        self._kicks = LoopKicks(hub) if hub is not None else None
        return self._kicks

    def new_claimer(self, connection: Any, hub: Any) -> Claimer:
        claimer = self.runtime.new_claimer(
            connection,
            queues=lambda: list(self.app.amqp.queues.consume_from.values()),
            accept=self.app.conf.accept_content,
            schedule=self._loop_kicks(hub),
            hub=hub,
            # Push pays where the broker's unacked count follows the slots (worker/push_consumer.py), under
            # both executions: a pass blocks the loop for a round trip and passes run one after another, so a
            # slot that frees during one waits for the next; pushed credit refills each slot a round trip after
            # its ack. Threads -c8 acks_late no-ops: 1.5x the pipelined gets (benchmarks/CLAIM_RESULTS.md).
            push=bool(self.app.conf.task_acks_late),
        )
        if hub is not None:
            for interval, fn in self.runtime.timers:
                hub.call_repeatedly(interval, fn)
        return claimer

    # -- ETA runs: counted while they wait, given a slot when due -----------------------
    def apply_eta_task(self, task: Any) -> None:
        self.runtime.when_admitted(task, lambda: Consumer.apply_eta_task(self, task))

    def when_due(self, request: HostRequest, go: Callable[[], None]) -> None:
        self.runtime.when_admitted(request, go)

    # -- what the claiming loop calls ----------------------------------------------
    def settle_dropped(self, message: HostMessage) -> None:
        self.runtime.settle_dropped(message)

    def run_scheduled(self) -> None:
        self.runtime.run_scheduled()

    def idle_poll_interval(self) -> float:
        return self.durable_config.idle_poll_interval

    # -- what the strategy and the revoke signal tell ------------------------------
    def _on_task_received(self, sender: Any = None, request: HostRequest | None = None, **_: Any) -> None:
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
        if self.task_consumer is not None and q.name not in {known.name for known in self.task_consumer.queues}:
            # Never consumed: the push consumer's queue list is what inspect
            # active_queues (and Flower's Queues tab) report.
            self.task_consumer.add_queue(q)
        self.runtime.add_queue(q.name)

    def cancel_task_queue(self, queue: str) -> None:
        queues = self.app.amqp.queues
        queues.deselect(queue)
        if self.task_consumer is not None:
            self.task_consumer.cancel_by_queue(queue)
        self.runtime.queue_cancelled(queue)

    # -- the pool resized by remote control (pool_grow / pool_shrink) ---------------
    def pool_resized(self) -> None:
        self.runtime.pool_resized(self.pool.num_processes)

    # -- shutdown ----------------------------------------------------------------
    def stop(self) -> None:
        self._stopping = True
        self.runtime.stop()
        super().stop()

    def on_close(self) -> None:
        # Celery calls this when the connection is lost, and when the consumer stops (Blueprint.close).
        super().on_close()
        if not self._stopping:
            # Lost: Celery drops every request the pool does not have yet, and the pool's late acks
            # cannot reach the broker. Stopped (a warm shutdown), the connection stays open until the
            # pool is joined: the runs finishing in it are acked as usual, and the drain hands back
            # the rest — skipping their acks here left a finished run's message to be restored at
            # close and run again.
            self.runtime.connection_lost()

    def shutdown(self) -> None:
        # A stopped worker leaves the gauges, and its signal receivers go with it
        # (connected with weak=False, they would keep it alive and called).
        try:
            super().shutdown()
        finally:
            disconnect_consumer(self, self._on_task_received, self._on_task_revoked)
            worker_gauges.unregister_worker(self.runtime)
            queue_metrics.unwatch(self._queue_watch)
            self.runtime.close_limits()
            self.runtime.leave_broker()

