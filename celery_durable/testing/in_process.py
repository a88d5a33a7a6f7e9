"""A ``-P durable`` worker inside the test process: Celery's embedded test worker, on a thread.

No subprocess to start and no app to import twice: a test gets a worker in
well under a second and its tasks run on the worker's threads (``durable_execution
= "threads"`` unless the test asks for prefork), so a breakpoint or a mock in
the test reaches them. Celery keeps a worker's state in module globals, so one
in-process worker runs at a time in a process.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from celery.contrib.testing.worker import start_worker

#: How long the embedded worker may take to stop at the end of the test.
STOP_TIMEOUT = 30.0

_running = threading.Lock()


class InProcessWorker:
    """A started embedded worker; ``stop()`` ends it (the plugin does at teardown)."""

    def __init__(self, app: Any, *, queues: Sequence[str] | None, concurrency: int, node_name: str) -> None:
        if not _running.acquire(blocking=False):
            raise RuntimeError("durable_worker(in_process=True): an in-process worker is already running in this "
                               "process (Celery keeps a worker's state in module globals); start one per test")
        self._stack = ExitStack()
        self._stack.callback(_running.release)
        try:
            self.controller = self._stack.enter_context(start_worker(
                app, pool="durable", concurrency=concurrency, loglevel="INFO", perform_ping_check=False,
                shutdown_timeout=STOP_TIMEOUT, hostname=node_name, queues=list(queues) if queues else None))
        except BaseException:
            self._stack.close()
            raise

    def stop(self) -> None:
        self._stack.close()
