"""compat.thread_pool on Celery's own thread pool: a stop cancels the runs not started and waits for the running."""

from __future__ import annotations

import threading
from typing import Any

from celery.concurrency.thread import TaskPool

from celery_durable.compat.thread_pool import cancel_unstarted_and_wait


def test_cancel_unstarted_and_wait_runs_none_queued_and_lets_the_running_one_finish() -> None:
    pool = TaskPool(limit=1)
    pool.start()
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def body(name: str) -> None:
        started.set()
        release.wait(5)
        ran.append(name)

    outcomes: list[Any] = []
    pool.apply_async(body, ("running",), callback=outcomes.append)
    assert started.wait(5)
    pool.apply_async(body, ("queued",), callback=outcomes.append)
    stopper = threading.Thread(target=cancel_unstarted_and_wait, args=(pool,))
    stopper.start()
    stopper.join(0.2)
    assert stopper.is_alive(), "returned before the running run finished"
    release.set()
    stopper.join(5)
    assert not stopper.is_alive()
    assert ran == ["running"]
