"""An outbox chain end to end: enqueued in a committed transaction, published by a relay, run by a
``celery worker -P durable``: each step once, in order, under the ids the enqueue returned.

The relay is the standalone ``celery durable relay`` process (the worker's own turned off), and,
as the brief asks, the worker's own relay: that one is expected to fail today, because
``worker/relay_step.py``'s ``OutboxRelay`` is a plain ``bootsteps.Step``, which Celery's consumer
blueprint never starts (only a ``StartStopStep`` is added to ``parent.steps``).
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


@pytest.fixture
def broker(request: pytest.FixtureRequest) -> tuple[str, str]:
    kind = getattr(request, "param", "redis")
    return kind, broker_url(kind)


@pytest.mark.parametrize(("broker", "relay"), [
    ("redis", "in-worker"), ("rabbitmq", "in-worker"), ("redis", "standalone"),
], indirect=["broker"])
def test_a_committed_chain_runs_its_steps_in_order_with_the_enqueued_ids(
        scenario: Any, broker: tuple[str, str], relay: str, tmp_path: Path) -> None:
    s: Scenario = scenario(["chain"])
    with fresh_store("postgresql", tmp_path) as url:
        ensure_schema(url)
        from tests.e2e.outboxapp import app

        app.conf.durable_database_url = url
        plain, durable = app.tasks["outbox.chain_step"], app.tasks["durable.outbox_chain_step"]
        # The worker's relay publishes (on NOTIFY); its default queue is the scenario's, where the
        # worker sends the later steps.
        conf: dict[str, Any] = {"durable_database_url": url}
        relays: list[RelayProcess] = []
        if relay == "standalone":
            conf["durable_relay"] = False
            relays.append(RelayProcess(s, conf, batch_size=10))
        worker = s.worker(conf=conf, app="tests.e2e.outboxapp", pool="durable", concurrency=2).wait_ready(60)
        user = sa.create_engine(url)
        try:
            with Session(user) as session, session.begin():
                result = outbox.enqueue(session, chain(plain.s([], "one"), durable.s("two"), plain.s("three")),
                                        queue=s.queues[0])
                # Rolled back with its transaction: none of its steps may run.
                with session.begin_nested() as nested:
                    dropped = outbox.enqueue(session, chain(plain.s([], "dropped-1"), plain.s("dropped-2")),
                                             queue=s.queues[0])
                    nested.rollback()
            ids = [result.parent.parent.id, result.parent.id, result.id]
            ended = wait_for(lambda: [e for e in s.ended() if e["label"] == "three"], timeout=30,
                             what="the chain's last step to end")
            assert ended[0]["id"] == ids[2]
            events = s.events()
            starts = [e for e in events if e["e"] == "start"]
            assert [e["label"] for e in starts] == ["one", "two", "three"], events
            assert [e["id"] for e in starts] == ids
            # In order: each step starts after the previous one ended, and gets its result.
            order = [(e["e"], e["label"]) for e in events]
            assert order == [("start", "one"), ("end", "one"), ("start", "two"), ("end", "two"),
                             ("start", "three"), ("end", "three")]
            assert [e["got"] for e in starts] == [[], ["one"], ["one", "two"]]
            # As chain.apply_async links them: the first step is the root, each the next one's parent.
            assert [e["root_id"] for e in starts] == [ids[0]] * 3
            assert [e["parent_id"] for e in starts] == [None, ids[0], ids[1]]
            assert [int(s.observer.get(f"{s.key}:runs:{i}") or 0) for i in ids] == [1, 1, 1]
            assert dropped.parent is not None and not s.observer.get(f"{s.key}:runs:{dropped.parent.id}")
            def runs() -> list[tuple[Any, ...]]:
                with user.connect() as conn:
                    found = conn.exec_driver_sql("SELECT id, task_name, state, result FROM durable_runs").all()
                return [tuple(r) for r in found if r[2] != "running"]

            with user.connect() as conn:
                rows = conn.exec_driver_sql("SELECT task_id, published_at FROM durable_outbox").all()
            # One row for the chain (its first step's id), published.
            assert [(r[0], r[1] is not None) for r in rows] == [(ids[0], True)]
            # The middle step ran as a durable run under its enqueued id; its result fed the third.
            settled = wait_for(runs, timeout=30, what="the durable step's run to settle")
            assert settled == [(ids[1], "durable.outbox_chain_step", "succeeded", '["one","two"]')]
        finally:
            user.dispose()
            worker.kill()
            for process in relays:
                process.stop()
