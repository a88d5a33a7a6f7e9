"""The consumer bootstep that runs the outbox relay in a thread of every ``-P durable`` worker."""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import bootsteps

from celery_durable.compat.worker_state import shutdown_requested

logger = logging.getLogger(__name__)

#: Seconds a shutdown waits for the relay's current pass (one batch) to finish.
JOIN_TIMEOUT = 10.0


class OutboxRelay(bootsteps.StartStopStep):
    """Starts the relay once per worker (``durable_relay = False`` turns it off); stops it at shutdown.

    A StartStopStep: the consumer's blueprint calls ``start`` only on those (a
    plain Step is created and never started).

    The consumer's ``stop``/``start`` also run on every broker reconnect; the
    relay keeps running through those (it backs off on its own while the broker
    is down), so only a worker shutdown stops it.
    """

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.relay: Any = None
        self.thread: threading.Thread | None = None

    def start(self, c: Any) -> None:
        config = getattr(c, "durable_config", None)
        if config is None or not config.relay or self.thread is not None:
            return
        from celery_durable import faults
        from celery_durable.outbox.relay import Relay

        self.relay = Relay(c.app, batch_size=config.relay_batch_size,
                           poll_interval=config.relay_poll_interval, retention=config.outbox_retention,
                           run_retention=config.run_retention, faults=faults.of(c.app))
        # Daemon: a relay stuck on a dead database must not hold the worker's exit.
        self.thread = threading.Thread(target=self._run, name="durable-outbox-relay", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.relay.run()
        except Exception:  # the worker keeps running tasks without its relay
            logger.exception("durable.relay.crashed", extra={"event": "durable.relay.crashed"})

    def stop(self, c: Any) -> None:
        if shutdown_requested():
            self.shutdown(c)

    def shutdown(self, c: Any) -> None:
        if self.relay is None or self.thread is None:
            return
        self.relay.stop()
        self.thread.join(JOIN_TIMEOUT)
        self.thread = None
