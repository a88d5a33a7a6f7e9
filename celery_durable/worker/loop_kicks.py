"""Run a callable soon on Celery's event loop, from any thread — the loop's own included.

From another thread a kick goes through a self-pipe the hub polls: a byte
written makes the poll return, and the callables queued run on the loop
thread. From the loop thread itself most kicks need no byte: a run's result
(prefork's result reader, an event callback) frees a slot while the hub
handles a poll's events, and kombu's hub (5.5 to 5.7) runs what ``call_soon`` queued
at the top of its next round, before it polls again. Writing the pipe there
cost a write, a wake-up and two reads per finished run (0.7 to 1.0 a task on
RabbitMQ, issue 28).

``call_soon`` alone is not enough: from the loop thread it never wakes the
poll, so a kick made after the round's queued callables ran (by one of them —
a claim pass that parked its messages must claim again at once — or by a
timer) would wait for the poll's timeout, up to a second. The hub's
``on_tick`` callbacks run last before it polls: ours writes the byte for any
kick still queued then, so that kick costs what it did before and waits no
longer.
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
    """A ``schedule(fn)`` for the claimer: ``fn`` runs on the hub's thread at its next round.

    Made on the thread that runs the hub (``claiming_loop`` builds the claimer, then runs Celery's loop).
    """

    def __init__(self, hub: Any) -> None:
        self._hub = hub
        self._loop_thread = threading.get_ident()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._pending: deque[Callable[[], None]] = deque()
        self._lock = threading.Lock()
        #: A ``call_soon`` of :meth:`_run_queued` is in the hub's ready set (loop thread only).
        self._soon = False
        #: A byte is in the pipe, or about to be: the poll returns at once, no other is needed.
        self._woken = False
        hub.add_reader(self._read_fd, self._run_pending)
        hub.on_tick.add(self._before_poll)

    def __call__(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._pending.append(fn)
        if threading.get_ident() != self._loop_thread:
            self._wake()
        elif not self._soon:
            self._soon = True
            self._hub.call_soon(self._run_soon)

    def _wake(self) -> None:
        self._woken = True
        try:
            os.write(self._write_fd, b"k")
        except (BlockingIOError, OSError):
            pass  # the pipe is full or closed: a wake-up is already pending, or the loop is gone

    def _before_poll(self) -> None:
        # Unlocked: a kick from another thread appending now writes the pipe itself.
        if self._pending and not self._woken:
            self._wake()

    def _run_soon(self) -> None:
        self._soon = False
        self._run_queued()

    def _run_pending(self) -> None:
        # Cleared before the drain: a byte written after it is read here or wakes the next poll, and
        # what its kick queued runs below either way (appended before the byte was written).
        self._woken = False
        try:
            while os.read(self._read_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        self._run_queued()

    def _run_queued(self) -> None:
        with self._lock:
            if not self._pending:
                return
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
        with self._lock:
            self._pending.clear()
        self._hub.on_tick.discard(self._before_poll)
        try:
            self._hub.remove(self._read_fd)
        except Exception:  # noqa: BLE001 - a hub already reset has forgotten the fd
            pass
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
