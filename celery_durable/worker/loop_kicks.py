"""Run a callable soon on Celery's event loop, from any thread — the loop's own included.

Celery's hub offers ``call_soon``, which wakes the loop only when called from
another thread: from the loop thread the callable waits for the next poll,
whose timeout is the next timer's (up to a second). A timer due now is no
better: the hub fires at most ten timers a round and then polls for a second.
A claim pass that parked its messages (a fleet limit was busy) must claim
again at once, so kicks go through a self-pipe the hub polls instead: a byte
written makes the poll return, and the callables queued run on the loop thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class LoopKicks:
    """A ``schedule(fn)`` for the claimer: ``fn`` runs on the hub's thread at its next round."""

    def __init__(self, hub: Any) -> None:
        self._hub = hub
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._pending: deque[Callable[[], None]] = deque()
        self._lock = threading.Lock()
        hub.add_reader(self._read_fd, self._run_pending)

    def __call__(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._pending.append(fn)
        try:
            os.write(self._write_fd, b"k")
        except (BlockingIOError, OSError):
            pass  # the pipe is full or closed: a wake-up is already pending, or the loop is gone

    def _run_pending(self) -> None:
        try:
            while os.read(self._read_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        with self._lock:
            ready, self._pending = self._pending, deque()
        # Each callable runs even if one before it raised: a kick dropped here would leave the
        # claimer's kick marked pending forever, and every later kick (the safety timer's too)
        # coalesced into it — a worker that never claims again.
        failed: BaseException | None = None
        for fn in ready:
            try:
                fn()
            except Exception as err:
                logger.exception("durable.loop.kick_failed: %s", err,
                                 extra={"event": "durable.loop.kick_failed", "error": repr(err)})
                failed = failed or err
        if failed is not None:
            raise failed

    def close(self) -> None:
        try:
            self._hub.remove(self._read_fd)
        except Exception:  # noqa: BLE001 - a hub already reset has forgotten the fd
            pass
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
