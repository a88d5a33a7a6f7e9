"""compat.asynpool: the prefork pool calls ``_event_process_exit`` for a dead child; its state is where we look."""

from __future__ import annotations

import inspect
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import billiard.pool
import pytest
from billiard.pool import RUN
from celery.concurrency.asynpool import AsynPool
from kombu.asynchronous import Hub

from celery_durable.compat.asynpool import ReapingAsynPool

#: Celery's own look at the pool (maintain_pool on a timer) comes after 5 s; the exit path is much sooner.
REPLACED_WITHIN = 3.0


class RecordingPool(ReapingAsynPool):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.exits: list[tuple[Any, Any]] = []
        super().__init__(*args, **kwargs)

    def _event_process_exit(self, hub: Any, proc: Any) -> None:
        self.exits.append((hub, proc))
        super()._event_process_exit(hub, proc)


def _terminate(pool: Any, hub: Hub) -> None:
    """Kill the pool's live children, then terminate it: dead children make its terminate short (it joins each)."""
    for proc in list(pool._pool):
        if proc.exitcode is None:
            os.kill(proc.pid, signal.SIGKILL)
    pool.terminate()
    hub.close()


@pytest.fixture(scope="module")
def pool_on_hub() -> Iterator[tuple[RecordingPool, Hub]]:
    """A one-child prefork pool registered with an event loop, as Celery's prefork TaskPool runs it.

    Shared by the module (a pool's terminate takes half a second); each test
    holds whatever child is listed at its start.
    """
    pool = RecordingPool(processes=1, threads=False)
    hub = Hub()
    try:
        pool.register_with_event_loop(hub)
        yield pool, hub
    finally:
        _terminate(pool, hub)


def test_asynpool_event_process_exit_takes_hub_and_proc() -> None:
    assert list(inspect.signature(AsynPool._event_process_exit).parameters) == ["self", "hub", "proc"]
    assert list(inspect.signature(AsynPool.maintain_pool).parameters)[0] == "self"


def test_billiard_pool_run_is_a_running_pools_state(pool_on_hub: tuple[RecordingPool, Hub]) -> None:
    pool, _ = pool_on_hub
    assert pool._state == RUN == billiard.pool.RUN
    assert billiard.pool.CLOSE != RUN and billiard.pool.TERMINATE != RUN


def test_asynpool_lists_its_children_in_pool(pool_on_hub: tuple[RecordingPool, Hub]) -> None:
    pool, _ = pool_on_hub
    [proc] = pool._pool
    assert isinstance(pool._pool, list)
    assert proc.pid and proc.is_alive()
    assert pool._still_listed(proc)


def test_asynpool_event_process_exit_runs_when_a_child_dies_and_maintain_pool_replaces_it(
        pool_on_hub: tuple[RecordingPool, Hub]) -> None:
    pool, hub = pool_on_hub
    pool.exits.clear()
    [proc] = pool._pool
    os.kill(proc.pid, signal.SIGKILL)
    loop = hub.create_loop()
    deadline = time.monotonic() + REPLACED_WITHIN
    while time.monotonic() < deadline and (pool._still_listed(proc) or not pool._pool):
        next(loop)
    assert pool.exits and pool.exits[0] == (hub, proc), "the child's sentinel must call _event_process_exit"
    assert not pool._still_listed(proc), f"the dead child was not reaped within {REPLACED_WITHIN}s"
    [replacement] = pool._pool
    assert replacement is not proc and replacement.is_alive()


def test_billiard_pool_state_leaves_run_when_terminated() -> None:
    pool = ReapingAsynPool(processes=1, threads=False)
    for proc in pool._pool:
        os.kill(proc.pid, signal.SIGKILL)
    pool.terminate()
    assert pool._state != RUN


def _answer() -> str:
    return "done"


#: The child waits 30 s for its result to be read (billiard's _ensure_messages_consumed): a join much
#: sooner means the result was read.
JOINED_WITHIN = 10.0


def test_a_job_written_to_a_child_before_its_ack_is_read_survives_flush_and_its_result_is_read() -> None:
    """The SIGTERM race (tests/e2e/test_drain_race.py) on the pool alone: Celery's flush forgets the job."""
    pool = ReapingAsynPool(processes=1, threads=False)
    hub = Hub()
    results: list[Any] = []
    try:
        pool.register_with_event_loop(hub)
        job = pool.apply_async(_answer, callback=results.append)
        loop = hub.create_loop()
        deadline = time.monotonic() + REPLACED_WITHIN
        # The job is written at the end of a loop turn; the child's ACK is read on a later one.
        while getattr(job, "_write_to", None) is None and time.monotonic() < deadline:
            next(loop)
        assert job._write_to is not None, "the job was never written to the child"
        assert not job._accepted, "the ACK was read on the turn that wrote the job: no race to test"
        pool.flush()
        assert job._job in pool._cache, "flush forgot a job the child has"
        pool.close()
        began = time.monotonic()
        pool.join()
        assert results == ["done"]
        assert time.monotonic() - began < JOINED_WITHIN
    finally:
        _terminate(pool, hub)


def _run_until(hub: Hub, condition: Any, what: str, within: float = REPLACED_WITHIN) -> None:
    loop = hub.create_loop()
    deadline = time.monotonic() + within
    while not condition() and time.monotonic() < deadline:
        next(loop)
    assert condition(), f"timed out after {within}s waiting for {what}"


def test_a_job_for_an_idle_child_is_written_at_once_and_a_busy_childs_waits_for_the_loop() -> None:
    # Celery's own send_job only queues: the write comes after a turn of the loop has polled the pipe.
    pool = ReapingAsynPool(processes=1, threads=False)
    hub = Hub()
    results: list[Any] = []
    try:
        pool.register_with_event_loop(hub)
        _run_until(hub, lambda: pool._all_inqueues, "the child to say it is up")
        first = pool.apply_async(_answer, callback=results.append)
        assert first._write_to is not None, "an idle child's job waited for the loop"
        assert not pool.outbound_buffer
        # The child has a job now: the next one is queued and written by the loop once it is free.
        second = pool.apply_async(_answer, callback=results.append)
        assert getattr(second, "_write_to", None) is None and list(pool.outbound_buffer) == [second]
        _run_until(hub, lambda: len(results) == 2, "both results")
        assert results == ["done", "done"] and second._write_to is not None
    finally:
        _terminate(pool, hub)
