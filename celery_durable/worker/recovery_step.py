"""The consumer bootstep that sweeps for stranded durable runs from a thread of every ``-P durable`` worker."""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import bootsteps

from celery_durable.compat.worker_state import shutdown_requested
from celery_durable.errors import StoreUnavailable

logger = logging.getLogger(__name__)

#: Sweeps per lease TTL: a stranded run is sent again within a third of a TTL of becoming one.
SWEEPS_PER_TTL = 3


class RunRecovery(bootsteps.StartStopStep):
    """Sends stranded runs again (tasks/recovery.py) every third of ``durable_lease_ttl``; stops at shutdown.

    Like the relay's step, it keeps running through broker reconnects (the
    consumer's stop/start) and ends only with the worker.
    """

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def start(self, c: Any) -> None:
        config = getattr(c, "durable_config", None)
        if config is None or self.thread is not None:
            return
        from celery_durable.store.engine import resolve_url

        url = resolve_url(config.database_url)
        interval = config.lease_ttl / SWEEPS_PER_TTL
        self.thread = threading.Thread(target=self._run, args=(c.app, url, config.lease_ttl, interval),
                                       name="durable-run-recovery", daemon=True)
        self.thread.start()

    def _run(self, app: Any, url: str, lease_ttl: float, interval: float) -> None:
        from celery_durable.tasks.recovery import recover_stranded

        while not self._stopped.wait(interval):
            try:
                recover_stranded(app, url, lease_ttl)
            except StoreUnavailable as exc:
                # The store's outage is reported where it is tracked; the next sweep tries again.
                logger.debug("durable.recovery.store_unavailable error=%s", exc)
            except Exception:  # noqa: BLE001 - the worker keeps running; the next sweep tries again
                logger.exception("durable.recovery.failed")

    def stop(self, c: Any) -> None:
        if shutdown_requested():
            self.shutdown(c)

    def shutdown(self, c: Any) -> None:
        self._stopped.set()
        if self.thread is not None:
            self.thread.join(5.0)
            self.thread = None
