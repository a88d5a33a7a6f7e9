"""The outbox with no relay on the PostgreSQL broker, with real workers: ``outbox.enqueue`` and
``celery_durable.transaction()`` send on commit only, once; and under a SIGKILLed, restarted worker every
committed task runs (durable: exactly once, plain: at least once) and no rolled-back one ever does."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery, Signature, chain
from sqlalchemy.orm import Session

import celery_durable
from celery_durable import outbox
from celery_durable.broker import register
from celery_durable.store.engine import ensure_schema
from tests.e2e.durableapp import EFFECTS_DDL
from tests.e2e.harness import Scenario, wait_for
from tests.stores import fresh_store

TTL = 2.0


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[tuple[Scenario, str]]:
    """A scenario whose broker and durable store are one fresh PostgreSQL schema; queue ``a``."""
    register()
    with fresh_store("postgresql", tmp_path) as url:
        engine = ensure_schema(url)
        with engine.begin() as conn:
            conn.exec_driver_sql(EFFECTS_DDL)
        s = Scenario("durable", f"durable+{url}", ["a"])
        try:
            yield s, url
        finally:
            s.cleanup()


def _outbox_rows(url: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM durable_outbox")).scalar_one())
    finally:
        engine.dispose()


def test_rollback_sends_nothing_and_commit_sends_once_enqueue_block_and_chain(pg: tuple[Scenario, str]) -> None:
    s, url = pg
    app: Celery = s.producer
    queue = s.by_name["a"]
    worker = s.worker(pool="durable", concurrency=2, conf={"durable_lease_ttl": TTL}).wait_ready()
    record = app.signature("e2e.record")

    def step(label: str) -> Signature:
        return app.signature("e2e.record", args=(label,), immutable=True, queue=queue)

    user = sa.create_engine(url)
    try:
        with Session(user) as session:
            with session.begin():
                outbox.enqueue(session, record.clone(("rolled-enqueue",)), queue=queue)
                with celery_durable.transaction(session, app):
                    app.send_task("e2e.record", ("rolled-block",), queue=queue)
                    chain(step("rolled-chain-1"),
                          step("rolled-chain-2")).apply_async()
                session.rollback()
            with session.begin():
                kept = [outbox.enqueue(session, record.clone(("kept-enqueue",)), queue=queue).id]
                with celery_durable.transaction(session, app):
                    kept.append(app.send_task("e2e.record", ("kept-block",), queue=queue).id)
                    last = chain(step("kept-chain-1"),
                                 step("kept-chain-2")).apply_async()
                kept += [last.parent.id, last.id]
        ended = s.wait_ended(4, timeout=30)
        # A rolled-back send would have started by the time the later, committed ones ended.
        wait_for(lambda: s.broker_depth("a") == 0, timeout=10, what="every row acked")
        assert sorted(e["id"] for e in s.ended()) == sorted(kept)
        assert sorted(e["label"] for e in ended) == ["kept-block", "kept-chain-1", "kept-chain-2", "kept-enqueue"]
        assert not s.labelled("start", "rolled")
        assert len(s.started()) == 4
        assert _outbox_rows(url) == 0
        assert worker.terminate() == 0
    finally:
        user.dispose()


THREADS, PER_THREAD = 3, 200


def test_under_a_killed_and_restarted_worker_committed_tasks_run_and_rolled_back_never(
        pg: tuple[Scenario, str]) -> None:
    s, url = pg
    queue = s.by_name["a"]
    app = Celery("e2e-pg-outbox-sender", broker=s.broker_url, set_as_current=False)
    app.conf.durable_database_url = url
    conf = {"durable_database_url": url, "durable_lease_ttl": TTL}
    durable, plain = app.signature("durable.outbox_record"), app.signature("outbox.chain_step")
    committed: dict[str, list[str]] = {"durable": [], "plain": []}
    rolled_back: list[str] = []
    lock = threading.Lock()
    user = sa.create_engine(url, pool_size=THREADS)

    def enqueue_many(thread: int) -> None:
        for i in range(PER_THREAD):
            n = thread * PER_THREAD + i
            keep, kind = n % 3 != 0, ("durable" if n % 2 else "plain")
            sig = durable.clone((f"d{n}",)) if kind == "durable" else plain.clone(([], f"p{n}"))
            with Session(user) as session, session.begin():
                if n % 4 < 2:
                    task_id = outbox.enqueue(session, sig, queue=queue).id
                else:
                    with celery_durable.transaction(session, app):
                        task_id = sig.apply_async(queue=queue).id
                if not keep:
                    session.rollback()
            with lock:
                (committed[kind] if keep else rolled_back).append(task_id)
            time.sleep(0.01)  # spread over the kill and the restart

    victim = s.worker(conf=conf, app="tests.e2e.outboxapp", concurrency=4).wait_ready(60)
    threads = [threading.Thread(target=enqueue_many, args=(n,)) for n in range(THREADS)]
    engine = sa.create_engine(url)

    def effects() -> list[str]:
        with engine.connect() as conn:
            return [r[0] for r in conn.exec_driver_sql("SELECT run_id FROM e2e_effects")]

    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(effects()) >= 20, timeout=60, what="the first worker to run some tasks")
        with lock:
            sent_at_kill = sum(map(len, committed.values())) + len(rolled_back)
        victim.kill()
        killed = time.time()
        survivor = s.worker(conf=conf, app="tests.e2e.outboxapp", concurrency=4).wait_ready(60)
        for t in threads:
            t.join(120)
        assert sum(map(len, committed.values())) + len(rolled_back) == THREADS * PER_THREAD
        wait_for(lambda: set(effects()) >= set(committed["durable"]), timeout=60,
                 what=f"{len(committed['durable'])} committed durable tasks to run", every=0.2)

        def lost_with_the_victim() -> set[str]:
            # A plain task is not acks_late: Celery acks it as it starts, so one the victim was running
            # when it was killed is gone, as on every broker (at most once). Only such a task may not end.
            ended = {e["id"] for e in s.labelled("end", "p")}
            return {e["id"] for e in s.labelled("start", "p") if e["t"] < killed} - ended

        def plain_settled() -> bool:
            ended = {e["id"] for e in s.labelled("end", "p")}
            return set(committed["plain"]) <= ended | lost_with_the_victim()

        try:
            wait_for(plain_settled, timeout=60, every=0.2,
                     what=f"{len(committed['plain'])} committed plain tasks to end (or to have been running "
                          f"on the killed worker)")
        except AssertionError:
            ended = {e["id"] for e in s.labelled("end", "p")}
            missing = set(committed["plain"]) - ended - lost_with_the_victim()
            starts = [(e["id"], round(e["t"] - killed, 3), e["pid"]) for e in s.labelled("start", "p")
                      if e["id"] in missing]
            raise AssertionError(f"{len(missing)} committed plain tasks never ended: {sorted(missing)[:10]}; "
                                 f"their starts (id, s after the kill, pid): {starts[:10]}") from None
        assert len(lost_with_the_victim() & set(committed["plain"])) <= 4  # the victim's concurrency
        wait_for(lambda: s.broker_depth("a") == 0, timeout=4 * TTL, what="every row acked")
        ran = effects()
        assert len(ran) == len(set(ran)), "a committed durable task's effect happened twice"
        assert set(ran) == set(committed["durable"])
        started = {e["id"] for e in s.started()}
        assert not started & set(rolled_back), "a rolled-back task ran"
        assert started >= set(committed["plain"])  # each plain one at least once (outbox.chain_step observes)
        assert sent_at_kill < THREADS * PER_THREAD, "the kill came after the last enqueue"
        assert _outbox_rows(url) == 0
        assert survivor.terminate() == 0
    finally:
        engine.dispose()
        user.dispose()
