"""Celery's thread pool beyond its documented API: the executor its runs are submitted to.

``celery.concurrency.thread.TaskPool`` runs each request on a
``concurrent.futures.ThreadPoolExecutor`` it keeps as ``executor`` (celery 5.x
``concurrency/thread.py``), undocumented; it is made in the pool's constructor,
so boot builds a throwaway pool to check it (compat.host_check).
"""

from __future__ import annotations

from typing import Any


def cancel_unstarted_and_wait(pool: Any) -> None:
    """Cancel the runs not started yet on a thread pool and wait for the running ones (a thread cannot be killed)."""
    pool.executor.shutdown(wait=True, cancel_futures=True)
