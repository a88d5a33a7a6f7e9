"""A run the pool got a moment before SIGTERM is recorded and acked once, and the warm shutdown stays prompt.

The race: at SIGTERM the consumer closes first and its ``on_close`` flushes the pool, which
forgets every job whose ACK it has not read yet, as if no child had it. A job already written to a
child runs there all the same; its result then goes unread (the pool's shutdown loop reads only while
it remembers a job), the child waits 30 s for the parent to read it, and with ``acks_late`` the message
is restored at close and runs again. compat/asynpool.py keeps such jobs.

Each try's worker (tests/e2e/sigterm_app.py) SIGTERMs itself on the loop turn that writes its one task's
job to the child, so the loop stops before it reads the child's ACK: the race, every try, where aiming
a SIGTERM from outside hits it a few times in ten under CPU load. Before the fix: 4 of 4 tries on Redis
(ran twice, exits in ~33 s), 3 of 4 on SQLite.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any

import pytest
from celery.result import AsyncResult

from tests.e2e.harness import Scenario, wait_for
from tests.services import REDIS_URL

#: Workers SIGTERMed per test (each boots a worker: CI time). The SIGTERM lands in the window every try on
#: Redis and 3 tries in 4 on SQLite, so two tries fail an unfixed worker nearly always.
TRIES = 2
#: The stock measurement (soak) takes more.
STOCK_TRIES = 4
#: A warm shutdown with nothing left to run takes a few seconds; the bug made it 30 s or more.
EXIT_BOUND = 10.0


def _race_once(s: Scenario, label: str, pool: str) -> tuple[str, float]:
    task_id = str(uuid.uuid4())
    worker = s.worker(conf=_conf(pool), concurrency=1, pool=pool, app="tests.e2e.sigterm_app",
                      env={"E2E_SIGTERM_ON_TASK": task_id,
                           "E2E_SIGTERM_WHEN": "next_turn" if s.broker_kind == "redis" else "now"}).wait_ready()
    s.send("q", label, task_id=task_id)
    wait_for(lambda: task_id in worker.log(), timeout=30, what=f"{label} to be received")
    began = time.monotonic()
    code = worker.process.wait(timeout=90)
    took = time.monotonic() - began
    worker.terminate()
    assert code == 0
    return task_id, took


def _conf(pool: str) -> dict[str, Any]:
    conf: dict[str, Any] = {"task_acks_late": True, "result_backend": REDIS_URL}
    if pool == "durable":
        conf["durable_max_in_flight"] = 1
    return conf


def _race(scenario: Any, pool: str, tries: int = TRIES) -> None:
    s = scenario(["q"])
    s.producer.conf.result_backend = REDIS_URL
    runs = [_race_once(s, f"race{attempt}", pool) for attempt in range(tries)]
    exits = [round(took, 1) for _, took in runs]
    ids = [task_id for task_id, _ in runs]
    # A run the SIGTERM stopped before its job reached a child went back to the broker unrun: the last
    # worker runs it. One that ran and went back anyway runs a second time here.
    last = s.worker(conf=_conf(pool), concurrency=1, pool=pool).wait_ready()
    wait_for(lambda: {e["id"] for e in s.ended()} >= set(ids) and s.broker_depth("q") == 0, timeout=60,
             what="every run to have ended and the queue to be empty")
    assert last.terminate() == 0
    starts = Counter(event["id"] for event in s.started())
    assert [starts[task_id] for task_id in ids] == [1] * tries, f"runs per task (exits took {exits} s)"
    assert [AsyncResult(task_id, app=s.producer).state for task_id in ids] == ["SUCCESS"] * tries
    assert max(exits) < EXIT_BOUND, f"a warm shutdown took {max(exits)} s (each: {exits})"


@pytest.mark.long
@pytest.mark.parametrize("broker", ["redis", "sqlite"], indirect=True)
def test_a_run_pooled_just_before_sigterm_is_acked_once_and_the_worker_exits_promptly(scenario):
    _race(scenario, "durable")


@pytest.mark.soak
@pytest.mark.xfail(reason="stock prefork forgets the job at the consumer's flush (measured: 3 of 4 tries on Redis, "
                          "2 of 4 on SQLite ran twice and exited in 33-37 s)", strict=False)
@pytest.mark.parametrize("broker", ["redis", "sqlite"], indirect=True)
def test_stock_prefork_under_the_same_race(scenario):
    """The same race on stock ``-P prefork``, which keeps the bug: a measurement, soak only, never in CI."""
    _race(scenario, "prefork", STOCK_TRIES)
