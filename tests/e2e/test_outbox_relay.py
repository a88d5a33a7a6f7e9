"""Outbox end to end: 2,000 enqueues from 4 threads, a third rolled back, relays racing, one SIGKILLed mid-batch;
and batched messages run by a stock worker and by the durable pool.

The race runs on each database with each broker: PostgreSQL (SKIP LOCKED,
LISTEN/NOTIFY) and SQLite (BEGIN IMMEDIATE admits one relay at a time; a
second one must still be safe), Redis (one MULTI/EXEC per batch) and RabbitMQ
(publisher confirms per batch).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session

from celery_durable import outbox
from celery_durable.outbox.relay import Relay
from celery_durable.store.engine import ensure_schema
from tests.e2e.durableapp import EFFECTS_DDL
from tests.e2e.harness import REPO, Scenario, wait_for
from tests.services import OBSERVE_URL, broker_url
from tests.stores import fresh_store

THREADS, PER_THREAD = 4, 500

#: (database, broker) pairs the race runs on: each store's claim of outbox rows and each transport's batched
#: publish once (the two are independent: the cross pairs proved nothing more, at half a minute each).
COMBINATIONS = [("postgresql", "redis"), ("sqlite", "rabbitmq")]


@pytest.fixture
def broker(request: pytest.FixtureRequest) -> tuple[str, str]:
    kind = getattr(request, "param", "redis")
    return kind, broker_url(kind)


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with fresh_store(request.param, tmp_path) as url:
        yield url


class RelayProcess:
    """``celery -A tests.e2e.outboxapp durable relay`` as a subprocess."""

    def __init__(self, scenario: Scenario, conf: dict[str, Any], batch_size: int) -> None:
        self.log_path = Path(os.environ.get("E2E_LOG_DIR", "/tmp")) / f"e2e-relay-{os.getpid()}-{id(self)}.log"
        env = dict(os.environ, E2E_BROKER=scenario.broker_url, E2E_QUEUES=",".join(scenario.queues),
                   E2E_CONF=json.dumps(conf), E2E_KEY=scenario.key, E2E_OBSERVE=OBSERVE_URL,
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.e2e.outboxapp", "durable", "relay",
             "--batch-size", str(batch_size)],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)
        self._log.close()


@pytest.mark.parametrize(("store", "broker"), COMBINATIONS, indirect=True,
                         ids=[f"{db}-{mq}" for db, mq in COMBINATIONS])
def test_every_committed_task_runs_once_through_racing_relays_and_a_killed_one(
        scenario: Any, store: str, broker: tuple[str, str]) -> None:
    s: Scenario = scenario(["outbox"])
    sqlite = store.startswith("sqlite")
    engine = ensure_schema(store)
    with engine.begin() as conn:
        conn.exec_driver_sql(EFFECTS_DDL)
    # SQLite has no NOTIFY: the relays poll, briskly so the test does not wait on them.
    conf = {"durable_database_url": store, "durable_relay_poll_interval": 0.1}
    from tests.e2e.outboxapp import app

    app.conf.durable_database_url = store
    task = app.tasks["durable.outbox_record"]
    relays: list[RelayProcess] = []
    # It stalls on its third publishing pass, its batch on the broker and not marked.
    doomed = RelayProcess(s, {**conf, "e2e_relay_stall_after": 3}, batch_size=200)
    relays.append(doomed)

    committed: list[str] = []
    rolled_back: list[str] = []
    lock = threading.Lock()
    # On SQLite a caller's commit waits for the one writer (a relay's batch, another thread's commit).
    user = sa.create_engine(store, pool_size=THREADS, **({"connect_args": {"timeout": 30}} if sqlite else {}))

    def enqueue_many(thread: int) -> None:
        for i in range(PER_THREAD):
            keep = (thread * PER_THREAD + i) % 3 != 0
            if i % 2:
                with Session(user) as session:
                    session.begin()
                    task_id = outbox.enqueue(session, task.s(f"{thread}-{i}"), queue=s.queues[0]).id
                    session.commit() if keep else session.rollback()
            else:
                with user.connect() as conn:
                    trans = conn.begin()
                    task_id = outbox.enqueue(conn, task.s(f"{thread}-{i}"), queue=s.queues[0]).id
                    trans.commit() if keep else trans.rollback()
            with lock:
                (committed if keep else rolled_back).append(task_id)

    threads = [threading.Thread(target=enqueue_many, args=(n,)) for n in range(THREADS)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: s.labelled("relay-stalled", "relay"), timeout=60,
                 what="the doomed relay to stall with a batch published but not marked")
        if sqlite:
            # Its BEGIN IMMEDIATE holds SQLite's one write lock: every other writer
            # waits for it, so it dies before the others start.
            doomed.process.send_signal(signal.SIGKILL)
            doomed.process.wait(30)
        # On PostgreSQL its batch stays locked: the racing relays skip it until the kill releases it.
        relays.append(RelayProcess(s, conf, batch_size=200))
        worker = s.worker(conf=conf, app="tests.e2e.outboxapp", concurrency=4).wait_ready(60)
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait(30)
        for t in threads:
            t.join(120)
        assert len(committed) + len(rolled_back) == THREADS * PER_THREAD

        def effects() -> list[str]:
            with engine.connect() as conn:
                return [r[0] for r in conn.exec_driver_sql("SELECT run_id FROM e2e_effects")]

        wait_for(lambda: len(set(effects())) >= len(committed), timeout=120,
                 what=f"{len(committed)} committed tasks to run", every=0.2)
        ran = effects()
        assert len(ran) == len(set(ran)), "a committed task's effect happened twice"
        assert set(ran) == set(committed)
        assert not set(ran) & set(rolled_back)
        with engine.connect() as conn:
            left = conn.exec_driver_sql("SELECT count(*) FROM durable_outbox WHERE published_at IS NULL").scalar()
        assert left == 0
        # The killed relay's published-but-unmarked rows went out a second time and were no-ops.
        wait_for(lambda: "durable.run.duplicate" in worker.log(), timeout=30,
                 what="the republished deliveries to reach the worker as duplicates")
    finally:
        for relay in relays:
            relay.stop()
        user.dispose()


@pytest.mark.parametrize("pool", ["prefork", "durable"])
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_batched_messages_run_on_a_stock_worker_and_on_the_durable_pool(
        scenario: Any, broker: tuple[str, str], pool: str, tmp_path: Path) -> None:
    s: Scenario = scenario(["batched"])
    with fresh_store("sqlite", tmp_path) as url:
        app = Celery("e2e-outbox-sender", broker=s.broker_url)
        app.conf.durable_database_url = url
        user = sa.create_engine(url)
        with user.begin() as conn:
            ids = [outbox.enqueue(conn, app.signature("e2e.record", args=(f"b{i}",)), queue=s.queues[0],
                                  priority=i % 10).id
                   for i in range(60)]
        result = Relay(app, batch_size=100).run_pass()
        user.dispose()
    assert (result.published, result.batched) == (60, 60)
    # The durable pool's own relay reads a store of its own, not the rows above.
    conf = {"durable_database_url": f"sqlite:///{tmp_path / 'worker.sqlite'}"} if pool == "durable" else {}
    s.worker(pool=pool, conf=conf, concurrency=2).wait_ready(60)
    ended = s.wait_ended(60, timeout=60)
    assert sorted(e["id"] for e in ended) == sorted(ids)
    assert {e["queue"] for e in ended} == {s.queues[0]}
