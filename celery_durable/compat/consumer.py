"""Celery's worker consumer where ``-P durable`` plugs in: its loop, its task consumer, two private hooks.

Celery has no public seam for "fetch tasks another way": the consumer's
``loop`` (``Consumer.loop``, called as ``self.loop(*self.loop_args())``) starts
the task consumer it is given, and ``asynloop`` drives it. ``-P durable``
replaces the loop with one that hands ``asynloop`` a stand-in task consumer
that claims instead of consuming.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from celery import bootsteps
from celery.worker.consumer import Consumer
from celery.worker.loops import asynloop

from celery_durable.compat.host_types import HostMessage, HostRequest
from celery_durable.compat.worker_state import raise_if_shutdown_requested


class Claiming(Protocol):
    """What the stand-in task consumer drives: the durable claimer."""

    handler: Callable[[Any], Any] | None

    def start(self) -> None: ...


class ClaimingTaskConsumer:
    """Stands in for the task consumer Celery's loop starts: it claims instead of consuming.

    ``asynloop`` sets ``on_message`` to the task handler and calls ``consume()``
    once the hub is registered (celery 5.x ``celery/worker/loops.py``); both go
    to the claimer. The handler is wrapped so ``settle(message)`` runs once
    Celery's strategy has returned.
    """

    def __init__(self, claimer: Claiming, settle: Callable[[Any], None] | None = None) -> None:
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

        def on_task_message(message: HostMessage) -> Any:
            try:
                return handler(message)
            finally:
                settle(message)

        self._claimer.handler = on_task_message

    def consume(self) -> None:
        self._claimer.start()


def claiming_loop(
    obj: Any,
    connection: Any,
    consumer: Any,
    blueprint: Any,
    hub: Any,
    qos: Any,
    heartbeat: Any,
    clock: Any,
    hbrate: float = 2.0,
) -> None:
    """``Consumer.loop`` for ``-P durable``: Celery's own with a hub, a short polling loop without one.

    Called with ``Consumer.loop_args()`` (celery 5.x: connection, task consumer,
    blueprint, hub, qos, heartbeat, clock, hbrate); ``consumer`` (Celery's push
    task consumer) is never started.
    """
    claimer = obj.new_claimer(connection, hub)
    stand_in = ClaimingTaskConsumer(claimer, obj.settle_dropped)
    try:
        if hub is not None:
            asynloop(obj, connection, stand_in, blueprint, hub, qos, heartbeat, clock, hbrate)
        else:
            _polling_loop(obj, connection, stand_in, blueprint)
    finally:
        claimer.stop()


def _polling_loop(obj: Any, connection: Any, stand_in: ClaimingTaskConsumer, blueprint: Any) -> None:
    # Transports without an event loop (the embedded SQLAlchemy broker): the
    # claim passes run here, between short drains that serve the idle wait
    # and remote control (what celery.worker.loops.synloop does for stock).
    stand_in.on_message = obj.create_task_handler()
    stand_in.consume()
    obj.on_ready()
    interval = obj.idle_poll_interval()
    while blueprint.state == bootsteps.RUN and obj.connection:
        raise_if_shutdown_requested()
        obj.perform_pending_operations()
        obj.run_scheduled()
        try:
            connection.drain_events(timeout=interval)
        except TimeoutError:
            pass
        except OSError:
            if blueprint.state == bootsteps.RUN:
                raise


def consumer_blueprint(*extra_steps: str) -> type[Any]:
    """Celery's consumer ``Blueprint`` with ``extra_steps`` (``module:Step`` paths) after its default steps.

    Celery documents adding consumer steps by ``app.steps['consumer'].add``,
    but that adds them to every consumer the app builds in the process, a
    stock worker's included (an embedded worker beside a durable one, a test
    harness): the outbox relay and the run recovery would run where no one
    asked for them. A consumer class's own steps are its ``Blueprint``'s
    ``default_steps`` (celery 5.x ``worker/consumer/consumer.py``), which
    Celery does not document: only this function names them.
    """
    steps = [*Consumer.Blueprint.default_steps, *extra_steps]
    return type("Blueprint", (Consumer.Blueprint,), {"default_steps": steps, "__module__": __name__})


class ConsumerHooks(Consumer):  # type: ignore[misc]
    """Celery's consumer with the private methods ``-P durable`` overrides, forwarded to public ones."""

    def when_due(self, request: HostRequest, go: Callable[[], None]) -> None:
        """Start ``request`` (``go``) once it fits; a subclass decides. Called when an ETA passes."""
        go()

    def _limit_post_eta(self, request: HostRequest, bucket: Any, tokens: Any) -> None:
        # Celery (>= 5.3) calls this when a rate-limited request's ETA passes,
        # instead of apply_eta_task: it must wait for a slot like any due run.
        self.when_due(request, lambda: Consumer._limit_post_eta(self, request, bucket, tokens))

    def pool_resized(self) -> None:
        """The pool grew or shrank by remote control; a subclass decides what follows."""

    def _update_prefetch_count(self, index: int = 0) -> None:
        # Celery's pool_grow/pool_shrink control commands call this after resizing
        # the pool, to move the push consumer's prefetch: -P durable never
        # push-consumes, its capacity follows the pool instead.
        self.pool_resized()

    def _restore_prefetch_count_after_connection_restart(self, p: Any, *args: Any) -> None:
        # Celery (>= 5.3, consumer.py) restores its push consumer's prefetch count
        # after a reconnect from each ack's promise: under thread execution that
        # runs on a pool thread, whose basic.qos then waits on the connection beside
        # the hub thread, and either may swallow the other's reply (the worker hangs
        # for good). -P durable never push-consumes tasks: there is nothing to restore.
        self._maximum_prefetch_restored = True
