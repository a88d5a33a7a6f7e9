"""The transactional outbox on real stores and brokers: rollback, commit, wrong database, broker down, wake-up."""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timezone
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery, chain, chord, group
from kombu import Connection
from sqlalchemy.orm import Session

from celery_durable import OutboxDatabaseMismatch, OutboxInvalid, outbox
from celery_durable.metrics.outbox import REGISTRY, store_label, watch
from celery_durable.outbox.relay import Relay
from celery_durable.store import outbox as store
from celery_durable.store.engine import autocommit, ensure_schema
from tests.conftest import MESSAGE_BROKERS
from tests.e2e.harness import wait_for
from tests.faultproxy import FaultProxy
from tests.services import broker_url

ProxyFactory = Callable[[str], FaultProxy]


def make_app(broker: str, store_url: str) -> Celery:
    app = Celery(f"outbox-{uuid.uuid4().hex[:6]}", broker=broker)
    app.conf.durable_database_url = store_url
    app.conf.broker_connection_retry_on_startup = True

    @app.task(name="outbox.noop", shared=False)
    def noop(label: str) -> str:  # pragma: no cover - never run here: the tests read the broker
        return label

    return app



def drain_ids(app: Celery, queue: str, *, quiet_for: float = 0.3) -> list[str]:
    """Every task id waiting in ``queue``, consumed; stops once the queue stayed empty ``quiet_for`` s."""
    ids: list[str] = []
    with Connection(app.conf.broker_url) as conn:
        simple = conn.SimpleQueue(queue, no_ack=True)
        try:
            while True:
                try:
                    message = simple.get(block=True, timeout=quiet_for)
                except simple.Empty:
                    return ids
                ids.append(message.headers["id"])
        finally:
            simple.close()


def outbox_row(store_url: str, task_id: str) -> dict[str, Any] | None:
    with autocommit(ensure_schema(store_url)).connect() as conn:
        return store.get(conn, task_id)


# The batch publishes differently per transport (a Redis pipeline, AMQP confirms): each is proven.
@pytest.mark.parametrize("broker", MESSAGE_BROKERS, indirect=True)
def test_rollback_publishes_nothing_commit_publishes_once(
        store_url: str, broker: tuple[str, str], user_engine: sa.engine.Engine) -> None:
    app = make_app(broker[1], store_url)
    queue = f"orders-{uuid.uuid4().hex[:8]}"
    noop = app.tasks["outbox.noop"]

    with Session(user_engine) as session, session.begin():
        committed = outbox.enqueue(session, noop.s("kept"), queue=queue, countdown=5, priority=3)
    with user_engine.connect() as conn:
        trans = conn.begin()
        rolled_back = outbox.enqueue(conn, noop.s("dropped"), queue=queue)
        trans.rollback()

    assert outbox_row(store_url, rolled_back.id) is None
    relay, other = Relay(app), Relay(app)
    assert relay.run_pass().published == 1
    # A second relay (and a second pass) finds nothing left: one publish per committed row.
    assert other.run_pass().claimed == 0 and relay.run_pass().claimed == 0
    assert drain_ids(app, queue) == [committed.id]
    row = outbox_row(store_url, committed.id)
    assert row is not None and row["published_at"] is not None and row["attempts"] == 0
    assert committed.id != rolled_back.id


def test_eta_and_args_travel_in_the_message(store_url: str, user_engine: sa.engine.Engine) -> None:
    app = make_app(broker_url("redis"), store_url)
    queue = f"eta-{uuid.uuid4().hex[:8]}"
    with user_engine.begin() as conn:
        result = outbox.enqueue(conn, app.tasks["outbox.noop"].s("x"), queue=queue, countdown=30,
                                headers={"tenant": "t1"})
    Relay(app).run_pass()
    with Connection(app.conf.broker_url) as conn:
        simple = conn.SimpleQueue(queue, no_ack=True)
        message = simple.get(block=True, timeout=5)
        simple.close()
    assert message.headers["id"] == result.id
    assert message.headers["tenant"] == "t1"
    assert message.headers["eta"] is not None
    assert message.decode()[0] == ["x"]
    # Made at enqueue, as apply_async makes it in the caller; not a message property.
    assert (message.headers["argsrepr"], message.headers["kwargsrepr"]) == ("['x']", "{}")
    assert "argsrepr" not in message.properties


def test_a_callers_argsrepr_masks_the_arguments_in_the_message(store_url: str,
                                                               user_engine: sa.engine.Engine) -> None:
    app = make_app(broker_url("redis"), store_url)
    queue = f"masked-{uuid.uuid4().hex[:8]}"
    with user_engine.begin() as conn:
        outbox.enqueue(conn, app.tasks["outbox.noop"].s("card-4242"), queue=queue, argsrepr="['<card>']")
        with pytest.raises(OutboxInvalid, match="kwargsrepr must be a string"):
            outbox.enqueue(conn, app.tasks["outbox.noop"].s("x"), queue=queue, kwargsrepr={"a": 1})
    Relay(app).run_pass()
    with Connection(app.conf.broker_url) as conn:
        simple = conn.SimpleQueue(queue, no_ack=True)
        message = simple.get(block=True, timeout=5)
        simple.close()
    assert message.headers["argsrepr"] == "['<card>']"
    assert message.decode()[0] == ["card-4242"]


def test_a_connection_on_another_database_is_refused(store_url: str, tmp_path: Any) -> None:
    app = make_app(broker_url("redis"), store_url)
    other = sa.create_engine(f"sqlite:///{tmp_path / 'not-the-durable-store.sqlite'}")
    with other.begin() as conn, pytest.raises(OutboxDatabaseMismatch, match="durable_database_url"):
        outbox.enqueue(conn, app.tasks["outbox.noop"].s("x"))
    other.dispose()


def test_canvas_and_non_json_arguments_are_refused(store_url: str, user_engine: sa.engine.Engine) -> None:
    app = make_app(broker_url("redis"), store_url)
    noop = app.tasks["outbox.noop"]
    with user_engine.begin() as conn:
        # Groups and chords fan out into several messages: refused, naming what is supported.
        with pytest.raises(OutboxInvalid, match="not a group") as refused:
            outbox.enqueue(conn, group(noop.s("a"), noop.s("b")))
        assert "chain of task signatures" in str(refused.value)
        with pytest.raises(OutboxInvalid, match="not a chord"):
            outbox.enqueue(conn, chord([noop.s("a"), noop.s("b")], noop.s()))
        # ... inside a chain too (``a | group(b, c)`` stays a chain holding a group, ``| d`` makes a chord).
        with pytest.raises(OutboxInvalid, match="a chain holding a group is not supported"):
            outbox.enqueue(conn, noop.s("a") | group(noop.s("b"), noop.s("c")))
        with pytest.raises(OutboxInvalid, match="a chain holding a chord is not supported"):
            outbox.enqueue(conn, noop.s("a") | group(noop.s("b"), noop.s("c")) | noop.s())
        with pytest.raises(OutboxInvalid, match="empty chain"):
            outbox.enqueue(conn, chain())
        with pytest.raises(OutboxInvalid, match="JSON"):
            outbox.enqueue(conn, noop.s(object()))
        with pytest.raises(OutboxInvalid, match="link"):
            outbox.enqueue(conn, noop.s("a"), link=noop.s())
        # A chain's callbacks, on the chain or on a step, would start again on a republish.
        with pytest.raises(OutboxInvalid, match="link callbacks"):
            outbox.enqueue(conn, noop.s("a") | noop.s(), link=noop.s())
        with pytest.raises(OutboxInvalid, match="link_error callbacks"):
            outbox.enqueue(conn, chain(noop.s("a"), noop.s()).set(link_error=noop.s()))
        with pytest.raises(OutboxInvalid, match="chain step outbox.noop: link callbacks"):
            outbox.enqueue(conn, noop.s("a") | noop.s().set(link=noop.s()))
        # A later step's non-JSON argument is refused naming that step's task.
        other = app.signature("outbox.other", args=(object(),))
        with pytest.raises(OutboxInvalid, match="the arguments of outbox.other must be JSON"):
            outbox.enqueue(conn, noop.s("a") | other)
        leftover = conn.exec_driver_sql("SELECT count(*) FROM durable_outbox").scalar()
    assert leftover == 0, "a refused enqueue left a row"


def _message(app: Celery, queue: str) -> Any:
    with Connection(app.conf.broker_url) as conn:
        simple = conn.SimpleQueue(queue, no_ack=True)
        try:
            return simple.get(block=True, timeout=5)
        finally:
            simple.close()


def _steps(embed_chain: list[dict[str, Any]]) -> list[tuple[str, list[Any], dict[str, Any]]]:
    """A body embed's chain as (task, args, options without the per-publish ids) tuples."""
    return [(s["task"], list(s["args"]), {k: v for k, v in s["options"].items() if k not in ("task_id", "reply_to")})
            for s in embed_chain]


def test_a_chain_is_published_as_chain_apply_async_would_with_the_ids_fixed_at_enqueue(
        store_url: str, user_engine: sa.engine.Engine) -> None:
    app = make_app(broker_url("redis"), store_url)
    noop = app.tasks["outbox.noop"]
    ours, native, dropped = (f"chain-{name}-{uuid.uuid4().hex[:8]}" for name in ("outbox", "native", "dropped"))

    def build() -> Any:
        # The later steps keep their own options; the enqueue's go to the first.
        return chain(noop.s("first"), noop.s().set(priority=7, headers={"step": 2}), noop.si("third"))

    with Session(user_engine) as session, session.begin():
        result = outbox.enqueue(session, build(), queue=ours, countdown=30)
    with user_engine.connect() as conn:
        trans = conn.begin()
        rolled_back = outbox.enqueue(conn, build(), queue=dropped)
        trans.rollback()
    native_result = build().apply_async(queue=native, countdown=30)

    # What chain.apply_async returns: the last step's result, parents leading to the first.
    assert result.parent is not None and result.parent.parent is not None
    assert result.parent.parent.parent is None
    third, second, first = result.id, result.parent.id, result.parent.parent.id
    assert len({first, second, third}) == 3
    # One row per enqueue, under the first step's id; the rolled-back one left nothing.
    assert outbox_row(store_url, first) is not None
    assert outbox_row(store_url, second) is None and outbox_row(store_url, third) is None
    assert outbox_row(store_url, rolled_back.parent.parent.id) is None

    assert Relay(app).run_pass().published == 1
    message, expected = _message(app, ours), _message(app, native)
    assert drain_ids(app, dropped, quiet_for=0.2) == []
    args, kwargs, embed = message.decode()
    assert message.headers["id"] == first
    # As on the native message: the first task is the root, with no parent.
    assert (message.headers["root_id"], message.headers["parent_id"]) == (first, None)
    assert (expected.headers["root_id"], expected.headers["parent_id"]) == (native_result.parent.parent.id, None)
    assert message.headers["eta"] is not None and expected.headers["eta"] is not None
    assert (args, kwargs) == (["first"], {}) == tuple(expected.decode()[:2])
    # The rest of the chain, last step first (the worker pops the next one), with the frozen ids.
    assert [s["options"]["task_id"] for s in embed["chain"]] == [third, second]
    assert _steps(embed["chain"]) == _steps(expected.decode()[2]["chain"])
    assert _steps(embed["chain"])[1] == ("outbox.noop", [], {"priority": 7, "headers": {"step": 2}})
    assert embed["chain"][0]["immutable"] is True
    assert (embed["callbacks"], embed["errbacks"], embed["chord"]) == (None, None, None)

    # A republish (a relay that died between publish and mark) carries the very same ids.
    with autocommit(ensure_schema(store_url)).connect() as conn:
        conn.execute(sa.text("UPDATE durable_outbox SET published_at = NULL WHERE task_id = :t"), {"t": first})
    assert Relay(app).run_pass().published == 1
    again = _message(app, ours)
    assert again.headers["id"] == first
    assert again.decode()[2]["chain"] == embed["chain"]


def test_a_chains_task_id_names_its_last_step_and_nested_chains_are_spliced(
        store_url: str, user_engine: sa.engine.Engine) -> None:
    app = make_app(broker_url("redis"), store_url)
    noop = app.tasks["outbox.noop"]
    queue = f"chain-id-{uuid.uuid4().hex[:8]}"
    with user_engine.begin() as conn:
        result = outbox.enqueue(conn, chain(noop.s("a"), chain(noop.s(), noop.s()), group(noop.s())),
                                queue=queue, task_id="the-last-one")
        single = outbox.enqueue(conn, chain(noop.s("only")), queue=queue)
    assert result.id == "the-last-one"
    ids = [result.id, result.parent.id, result.parent.parent.id, result.parent.parent.parent.id]
    assert Relay(app).run_pass().published == 2
    first, lone = _message(app, queue), _message(app, queue)
    assert first.headers["id"] == ids[-1]
    assert [s["options"]["task_id"] for s in first.decode()[2]["chain"]] == ids[:-1]
    # A chain of one is its task (chain.apply_async embeds an empty rest), the result is that task's.
    assert lone.headers["id"] == single.id and single.parent is None
    assert lone.decode()[2]["chain"] == []


def test_backlog_gauges_read_the_table_at_scrape(store_url: str, user_engine: sa.engine.Engine) -> None:
    app = make_app(broker_url("redis"), store_url)
    relay_url = Relay(app).url
    watch(relay_url)
    # This test's own store: other tests of the process watch theirs too.
    label = store_label(relay_url)

    def gauge(name: str) -> float:
        return float(REGISTRY.get_sample_value(name, {"store": label}) or 0.0)

    before = gauge("durable_outbox_backlog")
    with user_engine.begin() as conn:
        for i in range(3):
            outbox.enqueue(conn, app.tasks["outbox.noop"].s(str(i)), queue=f"g-{uuid.uuid4().hex[:6]}")
    assert gauge("durable_outbox_backlog") == before + 3
    assert gauge("durable_outbox_oldest_age_seconds") >= 0.0
    Relay(app).run_pass()
    assert gauge("durable_outbox_backlog") == 0
    assert gauge("durable_outbox_oldest_age_seconds") == 0


def test_failed_publishes_count_against_their_store(
        store_url: str, user_engine: sa.engine.Engine, fault_proxy: ProxyFactory) -> None:
    # durable_outbox_publish_failures_total{store} is what DurableOutboxPublishFailing
    # (examples/monitoring/alerts.yml) watches: a broker lost mid-batch and a broker never reached both count.
    real_url = broker_url("redis")
    proxy = fault_proxy(real_url)
    app = make_app(proxy.url_for(real_url), store_url)
    noop = app.tasks["outbox.noop"]
    queue = f"fail-{uuid.uuid4().hex[:6]}"
    relay = Relay(app)
    watch(relay.url)
    label = store_label(relay.url)

    def counter(name: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"store": label})

    def enqueue(label: str) -> str:
        with user_engine.begin() as conn:
            return outbox.enqueue(conn, noop.s(label), queue=queue).id

    # The series exist before anything failed: an alert's increase() sees the first failure.
    failures, published = counter("durable_outbox_publish_failures_total"), counter("durable_outbox_published_total")
    assert failures is not None and published is not None
    enqueue("first")
    assert relay.run_pass().published == 1  # the app's pool now holds a connection to the broker
    assert counter("durable_outbox_published_total") == published + 1

    lost = enqueue("lost")
    proxy.outage()
    try:
        result = relay.run_pass()
        assert result.error is not None and result.published == 0
        assert (outbox_row(store_url, lost) or {}).get("attempts") == 1
        assert counter("durable_outbox_publish_failures_total") == failures + 1
        # An app that never reached the broker: the pass fails before any row is tried, and counts.
        never = enqueue("never")
        with pytest.raises(Exception, match="onnect"):
            Relay(make_app(proxy.url_for(real_url), store_url)).run_pass()
        assert counter("durable_outbox_publish_failures_total") == failures + 2
        assert (outbox_row(store_url, never) or {}).get("attempts") == 0  # its claim rolled back
    finally:
        proxy.restore()
    assert counter("durable_outbox_published_total") == published + 1


@pytest.mark.parametrize("broker_kind", ["redis", "rabbitmq"])
def test_broker_down_keeps_rows_and_delivers_after_restart(
        store_url: str, user_engine: sa.engine.Engine, broker_kind: str, fault_proxy: ProxyFactory) -> None:
    # The relay reaches the broker through a proxy this test owns: the outage is the proxy's,
    # never the shared broker's.
    real_url = broker_url(broker_kind)
    proxy = fault_proxy(real_url)
    app = make_app(proxy.url_for(real_url), store_url)
    queue = f"down-{uuid.uuid4().hex[:8]}"
    noop = app.tasks["outbox.noop"]
    relay = Relay(app, poll_interval=0.05)
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    ids: list[str] = []
    try:
        with user_engine.begin() as conn:
            ids.append(outbox.enqueue(conn, noop.s("before"), queue=queue).id)
        wait_for(lambda: outbox_row(store_url, ids[0])["published_at"] is not None, timeout=10,
                 what="the first row to publish")
        try:
            proxy.outage()
            for i in range(20):
                with user_engine.begin() as conn:
                    ids.append(outbox.enqueue(conn, noop.s(f"during-{i}"), queue=queue).id)
            # The relay tried while the broker was down: the row stays, with the failure on it.
            wait_for(lambda: (outbox_row(store_url, ids[1]) or {}).get("attempts", 0) >= 1, timeout=15,
                     what="a failed publish to be recorded")
            assert relay.failures >= 1
            assert outbox_row(store_url, ids[1])["published_at"] is None
        finally:
            proxy.restore()
        wait_for(lambda: all(outbox_row(store_url, i)["published_at"] is not None for i in ids[1:]),
                 timeout=60, what="every row committed while the broker was down to publish")
        # The broker itself never went down: the row published before the outage is still queued.
        assert sorted(drain_ids(app, queue)) == sorted(ids)
    finally:
        relay.stop()
        thread.join(10)
    assert not thread.is_alive()


# LISTEN/NOTIFY is PostgreSQL's; on SQLite the relay polls.
@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_notify_wakes_the_relay_within_tens_of_ms(user_engine: sa.engine.Engine, store_url: str) -> None:
    app = make_app(broker_url("redis"), store_url)
    queue = f"notify-{uuid.uuid4().hex[:8]}"
    # A poll interval far above the figures below: only a notification explains them.
    relay = Relay(app, poll_interval=5.0)
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    latencies: list[float] = []
    try:
        wait_for(lambda: relay._waker is not None and relay._waker.listening, timeout=10,
                 what="the relay to LISTEN")
        for i in range(30):
            with user_engine.begin() as conn:
                task_id = outbox.enqueue(conn, app.tasks["outbox.noop"].s(str(i)), queue=queue).id
            committed = time.time()
            row = wait_for(lambda: (r := outbox_row(store_url, task_id)) and r["published_at"] and r,
                           timeout=4, what=f"row {i} to publish on notification", every=0.002)
            latencies.append(row["published_at"].astimezone(timezone.utc).timestamp() - committed)
    finally:
        relay.stop()
        thread.join(10)
    p50 = statistics.median(latencies)
    p99 = sorted(latencies)[int(len(latencies) * 0.99) - 1]
    print(f"commit-to-publish with LISTEN/NOTIFY: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")
    assert len(drain_ids(app, queue)) == 30


def test_the_first_enqueue_on_a_fresh_store_works_inside_a_transaction_that_already_wrote(
        store_url: str) -> None:
    """The caller's transaction holds the write lock (SQLite) before enqueue runs: the fresh store's
    schema is made in that transaction, not on a second connection waiting for that lock."""
    app = make_app(broker_url("redis"), store_url)
    queue = f"fresh-{uuid.uuid4().hex[:8]}"
    noop = app.tasks["outbox.noop"]
    engine = sa.create_engine(store_url)
    try:
        with engine.connect() as conn:
            trans = conn.begin()
            conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS user_orders (id INTEGER PRIMARY KEY)")
            conn.exec_driver_sql("INSERT INTO user_orders (id) VALUES (1)")
            dropped = outbox.enqueue(conn, noop.s("dropped"), queue=queue).id
            trans.rollback()  # the durable tables go with it
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS user_orders (id INTEGER PRIMARY KEY)")
            conn.exec_driver_sql("INSERT INTO user_orders (id) VALUES (2)")
            kept = outbox.enqueue(conn, noop.s("kept"), queue=queue).id
    finally:
        engine.dispose()
    assert Relay(app).run_pass().published == 1
    assert drain_ids(app, queue) == [kept]
    assert outbox_row(store_url, dropped) is None
