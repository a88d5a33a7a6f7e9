"""SIGTERM drain: stop claiming, let held runs finish under a deadline, hand the rest back to the broker."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from time import time
from typing import Any

from celery_durable.clock import SYSTEM_CLOCK, Clock
from celery_durable.compat.host_types import HostMessage
from celery_durable.config import DurableConfig
from celery_durable.headers import SENT_AT_HEADER, TASK_ID_HEADER
from celery_durable.worker.held_runs import HeldRun, HeldRuns

logger = logging.getLogger(__name__)

#: How often the drain looks whether the held runs are done.
_POLL_SECONDS = 0.05


class Drain:
    """The deadline half of a warm shutdown.

    Celery's warm shutdown already stops the consumer (no claim after it) and
    joins the pool; joining waits for every run with no bound. ``start()``
    runs beside that join: once ``durable_drain_timeout`` passes, each run
    still held goes back to the broker with its attempt unburned and its
    child process is killed so the join returns. Runs the pool never got
    (waiting for their ETA or a slot) go back as soon as the pool has no run left.
    """

    def __init__(self, held: HeldRuns, config: DurableConfig, republish_connection: Callable[[], Any],
                 *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._held = held
        self._config = config
        #: A broker connection for writing (``app.connection_for_write``), used as a context manager.
        self._republish_connection = republish_connection
        self._clock = clock
        self._thread: threading.Thread | None = None
        self.handed_back: list[HeldRun] = []

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, name="durable-drain", daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        held = self._held
        deadline = self._clock.monotonic() + self._config.drain_timeout
        count = held.held()
        logger.info("durable.drain.started held=%s", count, extra={"event": "durable.drain.started", "held": count})
        # Only runs the pool has can still finish: the consumer (and with it
        # Celery's ETA timer) stopped before the pool, so a run waiting for its
        # ETA or for a slot will never reach the pool. Waiting for one would
        # hold every shutdown to the deadline (30 s by default) for nothing.
        while self._pool_has_runs() and self._clock.monotonic() < deadline:
            threading.Event().wait(_POLL_SECONDS)
        left = held.snapshot()
        if not left:
            logger.info("durable.drain.finished", extra={"event": "durable.drain.finished"})
            return
        if not self._pool_has_runs():
            logger.info("durable.drain.not_started handing back=%s: runs that never reached the pool "
                        "(waiting for their ETA or a slot) go back at once", len(left),
                        extra={"event": "durable.drain.not_started", "handing_back": len(left)})
            for run in left:
                self._hand_back(run)
            return
        if self._config.execution == "threads":
            # A thread cannot be stopped: handing back a run that is running
            # would run it twice. Only runs that have not started go back;
            # the pool then waits for the running ones, as stock Celery does.
            running = [run for run in left if _started(run)]
            left = [run for run in left if not _started(run)]
            if running:
                logger.warning(
                    "durable.drain.threads_running held=%s: threads cannot be stopped; "
                    "waiting for them to return", len(running),
                    extra={"event": "durable.drain.threads_running", "running": len(running)},
                )
        logger.warning("durable.drain.deadline handing back=%s to the broker", len(left),
                       extra={"event": "durable.drain.deadline", "handing_back": len(left)})
        for run in left:
            self._hand_back(run)

    def _pool_has_runs(self) -> bool:
        return any(run.in_pool for run in self._held.snapshot())

    def _hand_back(self, run: HeldRun) -> None:
        run.handed_back = True
        message = run.message
        task_id = _task_id(message)
        try:
            if not message.acknowledged:
                message.reject(requeue=True)
            else:
                # Acked at start (acks_late off): the broker no longer has it,
                # so a copy goes back, same id, same retry count.
                self._republish(message, run.queue)
        except Exception:  # logged with the task id; nothing else can be done here
            logger.exception("durable.drain.hand_back_failed queue=%s id=%s", run.queue, task_id,
                             extra={"event": "durable.drain.hand_back_failed", "queue": run.queue, "task_id": task_id})
        else:
            logger.info("durable.drain.handed_back queue=%s id=%s", run.queue, task_id,
                        extra={"event": "durable.drain.handed_back", "queue": run.queue, "task_id": task_id})
        self.handed_back.append(run)
        pid = getattr(run.request, "worker_pid", None) if run.request is not None else None
        if pid and pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _republish(self, message: HostMessage, queue: str) -> None:
        delivery = message.delivery_info or {}
        properties = dict(message.properties or {})
        properties.pop("delivery_tag", None)
        properties.pop("delivery_info", None)
        with self._republish_connection() as connection:
            connection.Producer().publish(
                message.body,
                exchange=delivery.get("exchange", ""),
                routing_key=delivery.get("routing_key") or queue,
                headers={**(message.headers or {}), SENT_AT_HEADER: time()},  # ready again from now
                content_type=message.content_type,
                content_encoding=message.content_encoding,
                serializer=None,
                retry=True,
                **{k: v for k, v in properties.items() if k in ("correlation_id", "reply_to", "priority")},
            )


def _started(run: HeldRun) -> bool:
    return run.request is not None and getattr(run.request, "time_start", None) is not None


def _task_id(message: HostMessage) -> Any:
    headers = message.headers or {}
    return headers.get(TASK_ID_HEADER)
