"""``-P durable``'s thread execution (``durable_execution = "threads"``): Celery's thread pool reporting each
finished run, draining at shutdown."""

from __future__ import annotations

from celery.concurrency.thread import TaskPool as ThreadTaskPool

from celery_durable.compat.thread_pool import cancel_unstarted_and_wait
from celery_durable.worker.pool import DurablePoolMixin


class DurableThreadPool(DurablePoolMixin, ThreadTaskPool):
    """Thread execution (``durable_execution = "threads"``)."""

    def on_stop(self) -> None:
        drain = getattr(self, "drain", None)
        if drain is None:
            super().on_stop()
            return
        drain.start()
        drain.join()
        # Runs not yet started were handed back: cancel them here; the running
        # ones (a thread cannot be killed) are waited for.
        cancel_unstarted_and_wait(self)
