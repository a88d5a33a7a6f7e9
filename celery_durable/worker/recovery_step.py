"""The consumer bootstep that sweeps for stranded durable runs from a thread of every ``-P durable`` worker."""

from __future__ import annotations

import logging
import threading
from time import monotonic
from typing import Any

from celery import bootsteps

from celery_durable.compat.worker_state import shutdown_requested

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
        from celery_durable.store import outage
        from celery_durable.tasks.recovery import recover_stranded, touch

        # Since when this worker has reached the store without a break. After an outage every lease
        # is old, the live attempts' too: they get a TTL to renew before any run is judged stranded.
        reachable_since: float | None = None
        wait = 0.0  # the first look at once: a worker's TTL of waiting starts when it boots
        while not self._stopped.wait(wait):
            wait = interval
            try:
                if reachable_since is not None and monotonic() - reachable_since >= lease_ttl:
                    recover_stranded(app, url, lease_ttl)
                else:
                    touch(url)
                    reachable_since = reachable_since if reachable_since is not None else monotonic()
            except Exception as err:  # noqa: BLE001 - the worker keeps running; the next sweep tries again
                reachable_since = None
                # An unreachable store is one line per outage (the tracker's); anything else is loud.
                outage.failed(url, err, "durable.recovery.failed", level=logging.WARNING,
                              then="tried again at the next sweep")
            else:
                outage.available(url)

    def stop(self, c: Any) -> None:
        if shutdown_requested():
            self.shutdown(c)

    def shutdown(self, c: Any) -> None:
        self._stopped.set()
        if self.thread is not None:
            self.thread.join(5.0)
            self.thread = None
