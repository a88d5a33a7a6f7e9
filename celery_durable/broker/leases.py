"""The heartbeat that keeps a consumer's rows its own: one renewal of all of them every third of the TTL."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class Heartbeat(Protocol):
    """A process's one heartbeat that renewals can join (``leases.keeper.LeaseKeeper``)."""

    def hold_beat(self, key: str, renew: Callable[[], Any], ttl: float) -> None: ...

    def release_beat(self, key: str) -> None: ...


class RowLeaseKeeper:
    """Calls ``renew()`` every ``ttl / 3`` seconds on a daemon thread, from ``start()`` until ``stop()``.

    A renewal that fails (the database out) is logged and tried again next beat:
    the rows stay held until their lease lapses, which is what a dead holder's do too.
    """

    def __init__(self, renew: Callable[[], int], ttl: float, name: str = "durable-broker-leases") -> None:
        self._renew = renew
        self._ttl = ttl
        #: The worker's heartbeat this one's renewals moved to (``beat_with``): then no thread of its own.
        self._heartbeat: Heartbeat | None = None
        self._beating = False
        self._interval = ttl / 3.0
        self._name = name
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def beat_with(self, heartbeat: Heartbeat) -> None:
        """Renew on ``heartbeat`` (a ``-P durable`` worker's lease keeper) instead of a thread of its own."""
        with self._lock:
            if self._thread is not None:
                self._stopped.set()  # its own thread, if one started, ends at its next beat
            self._heartbeat = heartbeat
            if self._thread is not None:
                self._join_heartbeat()

    def _join_heartbeat(self) -> None:
        if not self._beating and self._heartbeat is not None:
            self._heartbeat.hold_beat(self._name_key(), self._renew, self._ttl)
            self._beating = True

    def _name_key(self) -> str:
        return f"{self._name}:{id(self)}"

    def start(self) -> None:
        with self._lock:
            if self._heartbeat is not None:
                self._join_heartbeat()  # once: a claim pass costs the heartbeat nothing
                return
            if self._thread is not None or self._stopped.is_set():
                return
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._lock:
            if self._heartbeat is not None and self._beating:
                self._heartbeat.release_beat(self._name_key())
                self._beating = False
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
