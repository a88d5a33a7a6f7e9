"""The heartbeat that keeps a consumer's rows its own: one renewal of all of them every third of the TTL."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class RowLeaseKeeper:
    """Calls ``renew()`` every ``ttl / 3`` seconds on a daemon thread, from ``start()`` until ``stop()``.

    A renewal that fails (the database out) is logged and tried again next beat:
    the rows stay held until their lease lapses, which is what a dead holder's do too.
    """

    def __init__(self, renew: Callable[[], int], ttl: float, name: str = "durable-broker-leases") -> None:
        self._renew = renew
        self._interval = ttl / 3.0
        self._name = name
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is not None or self._stopped.is_set():
                return
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._interval + 1.0)

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._renew()
            except Exception as err:  # noqa: BLE001 - the next beat tries again; the lease covers two misses
                logger.warning("durable.broker.renew_failed: %s", err,
                               extra={"event": "durable.broker.renew_failed"})
