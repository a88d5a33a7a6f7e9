"""``task_send_sent_event`` on (Flower setups turn it on): the outbox and the durable beat still publish, and
each task they send is announced by exactly one ``task-sent`` event, heard on the broker as Flower hears it.

A real ``-P durable`` worker (its own relay, or the standalone ``celery durable relay``) and a real durable
beat replica, both with the setting on; an enqueued task, an enqueued chain (its later steps sent by the
worker, through Celery's own path) and one enqueue rolled back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import chain
from sqlalchemy.orm import Session

from celery_durable import outbox
from celery_durable.store.engine import ensure_schema
from tests.e2e.harness import Scenario, wait_for
from tests.e2e.test_outbox_relay import RelayProcess
from tests.services import broker_url
from tests.stores import fresh_store
from tests.task_events import listening


@pytest.fixture
def broker(request: pytest.FixtureRequest) -> tuple[str, str]:
    kind = getattr(request, "param", "redis")
    return kind, broker_url(kind)


@pytest.mark.parametrize(("broker", "relay"), [
    ("redis", "in-worker"), ("rabbitmq", "in-worker"), ("redis", "standalone"),
], indirect=["broker"])
def test_the_outbox_and_the_beat_publish_and_announce_each_task_once_with_sent_events_on(
        scenario: Any, broker: tuple[str, str], relay: str, tmp_path: Path) -> None:
    s: Scenario = scenario(["sent", "ticks"])
    with fresh_store("postgresql", tmp_path) as url, listening(broker[1]) as heard:
        ensure_schema(url)
        from tests.e2e.outboxapp import app

        app.conf.durable_database_url = url
        plain, durable = app.tasks["outbox.chain_step"], app.tasks["durable.outbox_chain_step"]
        conf: dict[str, Any] = {"durable_database_url": url, "task_send_sent_event": True}
        relays: list[RelayProcess] = []
        if relay == "standalone":
            relays.append(RelayProcess(s, {**conf, "durable_relay": False}, batch_size=10))
            conf["durable_relay"] = False
        s.worker(conf=conf, queues=["sent"], app="tests.e2e.outboxapp", pool="durable",
                 concurrency=2).wait_ready(60)
        # A tick every second, sent by the beat's own relay pass, run by a worker of the beat's app.
        s.worker(conf=conf, queues=["ticks"], app="tests.e2e.beatapp", pool="durable", concurrency=1).wait_ready(60)
        tick = {"raw": {"task": "beat.tick", "schedule": 1.0, "args": ["tick"],
                        "options": {"queue": s.by_name["ticks"]}}}
        s.beat(conf=conf, entries={"tick": tick}).wait_started()
        user = sa.create_engine(url)
        try:
            with Session(user) as session, session.begin():
                single = outbox.enqueue(session, plain.s([], "single"), queue=s.queues[0])
                steps = outbox.enqueue(session, chain(plain.s([], "one"), durable.s("two"), plain.s("three")),
                                       queue=s.queues[0])
                with session.begin_nested() as nested:
                    dropped = outbox.enqueue(session, plain.s([], "dropped"), queue=s.queues[0])
                    nested.rollback()

            def started(label: str) -> list[dict[str, Any]]:
                return [e for e in s.events() if e["e"] == "start" and e["label"] == label]

            wait_for(lambda: started("single") and started("three") and len(started("tick")) >= 2, timeout=45,
                     what="the enqueued task, the chain's last step and two beat ticks to start")
            sent_ids = [single.id, steps.parent.parent.id, steps.parent.id, steps.id,
                        *[e["id"] for e in started("tick")]]
            wait_for(lambda: all(heard.task_sent(task_id) for task_id in sent_ids), timeout=10,
                     what="a task-sent event for every task that was sent")
            # Each sent task announced once (the chain's later steps by the worker, as stock Celery does),
            # with the queue it went to; the rolled-back one neither sent nor announced.
            assert {task_id: len(heard.task_sent(task_id)) for task_id in sent_ids} == dict.fromkeys(sent_ids, 1)
            assert [heard.task_sent(task_id)[0]["queue"] for task_id in sent_ids] == \
                [s.queues[0]] * 4 + [s.by_name["ticks"]] * (len(sent_ids) - 4)
            assert heard.task_sent(dropped.id) == [] and started("dropped") == []
            # Once each: the relay's rows were marked published, not retried.
            assert [len(started(label)) for label in ("single", "one", "two", "three")] == [1, 1, 1, 1]
            with user.connect() as conn:
                unpublished = conn.exec_driver_sql(
                    "SELECT count(*) FROM durable_outbox WHERE published_at IS NULL").scalar()
            assert unpublished in (0, 1), "at most the tick enqueued this second waits for its pass"
        finally:
            user.dispose()
            for process in relays:
                process.stop()
