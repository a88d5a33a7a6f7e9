"""Exchanges across processes on the broker that claims rows, on PostgreSQL and SQLite: a broadcast reaches the
queues other connections bound, a reply reaches the key only the asker bound, a topic reaches every monitor,
and the bindings of a queue nobody consumes lapse with its messages (what remote control and events need).

Each kombu ``Connection`` keeps its own in-memory bindings, so two connections here are two processes as far
as routing goes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from kombu import Connection, Consumer, Exchange, Queue

from celery_durable.store.engine import autocommit, ensure_schema

BROADCAST = Exchange("ctl.pidbox", "fanout", durable=False, auto_delete=True)
REPLY = Exchange("reply.ctl.pidbox", "direct", durable=False, auto_delete=True)
EVENTS = Exchange("ev", "topic", durable=False)


@pytest.fixture
def connect(broker_db: str) -> Iterator[Callable[[], Connection]]:
    """A new kombu connection to the broker: a process of its own as far as bindings go."""
    opened: list[Connection] = []

    def open_one() -> Connection:
        connection = Connection(f"durable+{broker_db}", transport_options={"durable_lease_ttl": 3.0})
        connection.connect()
        opened.append(connection)
        return connection

    yield open_one
    for connection in opened:
        connection.release()


def _bindings(broker_db: str) -> list[tuple[str, str, str]]:
    with autocommit(ensure_schema(broker_db)).connect() as conn:
        return [tuple(row) for row in conn.execute(sa.text(
            "SELECT exchange, routing_key, queue FROM durable_broker_bindings ORDER BY queue"))]


def _rows(broker_db: str) -> list[str]:
    # A read that takes no lock (the store's engine begins each transaction IMMEDIATE on SQLite).
    with autocommit(ensure_schema(broker_db)).connect() as conn:
        return [row.queue for row in conn.execute(sa.text("SELECT queue FROM durable_broker_messages ORDER BY id"))]


def _body(connection: Connection, queue: Queue) -> Any:
    message = queue(connection.default_channel).get(no_ack=True)
    return None if message is None else message.payload


def _flush_acks(connection: Connection) -> None:
    """Send the connection's batched acks now (they go with its next statement otherwise)."""
    connection.default_channel.connection.rows.flush_acks()


def test_a_broadcast_reaches_the_queues_every_other_connection_bound_once_each(connect, broker_db):
    workers = [connect(), connect()]
    queues = [Queue(f"w{i}.ctl.pidbox", BROADCAST, expires=10.0, durable=False, auto_delete=True) for i in (1, 2)]
    for worker, queue in zip(workers, queues):
        queue(worker.default_channel).declare()
    client = connect()
    client.Producer().publish({"method": "ping"}, exchange=BROADCAST, declare=[BROADCAST])
    assert [_body(worker, queue) for worker, queue in zip(workers, queues)] == [{"method": "ping"}] * 2
    assert [_body(worker, queue) for worker, queue in zip(workers, queues)] == [None, None]


def test_a_reply_reaches_the_key_only_the_asking_connection_bound(connect, broker_db):
    client = connect()
    reply_queue = Queue("oid-1.reply.ctl.pidbox", REPLY, routing_key="oid-1", expires=10.0, auto_delete=True)
    reply_queue(client.default_channel).declare()
    worker = connect()
    # The worker declares the exchange and binds nothing to it: its own table has no route for the key.
    worker.Producer().publish({"ok": "pong"}, exchange=REPLY, routing_key="oid-1", declare=[REPLY])
    assert _body(client, reply_queue) == {"ok": "pong"}
    _flush_acks(client)
    # A key nobody bound routes nowhere, as RabbitMQ drops an unroutable message.
    worker.Producer().publish({"ok": "lost"}, exchange=REPLY, routing_key="oid-unknown", declare=[REPLY])
    assert _rows(broker_db) == []


def test_every_monitor_bound_to_a_topic_gets_each_event(connect, broker_db):
    monitors = [connect(), connect()]
    queues = [Queue(f"ev.m{i}", EVENTS, routing_key="#", expires=60.0, auto_delete=True) for i in (1, 2)]
    for monitor, queue in zip(monitors, queues):
        queue(monitor.default_channel).declare()
    gossip = Queue("ev.gossip", EVENTS, routing_key="worker.#", auto_delete=True)
    emitter = connect()
    gossip(emitter.default_channel).declare()  # the emitter's own binding does not hide the monitors'
    producer = emitter.Producer()
    producer.publish({"type": "task-succeeded"}, exchange=EVENTS, routing_key="task.succeeded", declare=[EVENTS])
    producer.publish({"type": "worker-heartbeat"}, exchange=EVENTS, routing_key="worker.heartbeat")
    for monitor, queue in zip(monitors, queues):
        assert [_body(monitor, queue), _body(monitor, queue)] == [{"type": "task-succeeded"},
                                                                   {"type": "worker-heartbeat"}]
    assert _body(emitter, gossip) == {"type": "worker-heartbeat"}


def test_a_task_queue_under_its_own_name_records_no_shared_binding(connect, broker_db):
    producer = connect()
    tasks = Queue("default", Exchange("default"), routing_key="default")
    producer.Producer().publish({"task": 1}, exchange=tasks.exchange, routing_key="default", declare=[tasks])
    assert _bindings(broker_db) == []
    assert _rows(broker_db) == ["default"]


def test_a_queue_nobody_consumes_past_its_expiry_loses_its_binding_and_its_messages(connect, broker_db):
    gone_worker, live_worker, client = connect(), connect(), connect()
    stale = Queue("gone.ctl.pidbox", BROADCAST, expires=0.5, auto_delete=True)
    live = Queue("live.ctl.pidbox", BROADCAST, expires=0.5, auto_delete=True)
    stale(gone_worker.default_channel).declare()
    client.Producer().publish({"n": 1}, exchange=BROADCAST, declare=[BROADCAST])
    assert sorted(_rows(broker_db)) == ["gone.ctl.pidbox"]
    # The live worker consumes its queue: its drain refreshes its binding and drops the lapsed one.
    received: list[Any] = []
    with Consumer(live_worker, [live], callbacks=[lambda body, message: received.append(body)], no_ack=True):
        deadline = time.monotonic() + 10
        while ("gone.ctl.pidbox" in {q for _, _, q in _bindings(broker_db)} or "gone.ctl.pidbox" in _rows(broker_db)):
            assert time.monotonic() < deadline, f"the lapsed binding stayed: {_bindings(broker_db)}"
            try:
                live_worker.drain_events(timeout=0.2)
            except TimeoutError:
                pass
        client.Producer().publish({"n": 2}, exchange=BROADCAST)
        deadline = time.monotonic() + 10
        while not received:
            assert time.monotonic() < deadline, "the live queue missed the broadcast"
            try:
                live_worker.drain_events(timeout=0.2)
            except TimeoutError:
                pass
    assert received == [{"n": 2}]
    assert [q for _, _, q in _bindings(broker_db)] == ["live.ctl.pidbox"]


def test_a_consumer_without_acks_leaves_no_row_behind_and_a_deleted_queue_no_binding(connect, broker_db):
    client, worker = connect(), connect()
    reply_queue = Queue("oid-2.reply.ctl.pidbox", REPLY, routing_key="oid-2", expires=10.0, auto_delete=True)
    bound = reply_queue(client.default_channel)
    bound.declare()
    worker.Producer().publish({"ok": 1}, exchange=REPLY, routing_key="oid-2", declare=[REPLY])
    received: list[Any] = []
    with Consumer(client, [reply_queue], callbacks=[lambda body, message: received.append(body)], no_ack=True):
        client.drain_events(timeout=5)
    assert received == [{"ok": 1}]
    _flush_acks(client)
    assert _rows(broker_db) == []
    bound.delete()
    assert _bindings(broker_db) == []


def test_a_sent_event_of_an_enqueue_inside_a_write_transaction_is_routed_without_waiting_for_it(connect, broker_db):
    """``task_send_sent_event`` with ``outbox.enqueue``: the event is routed (a read of the shared bindings)
    while the caller's transaction holds SQLite's write lock, and goes out with the task on commit."""
    from celery import Celery

    import celery_durable
    from celery_durable import outbox

    monitor = connect()
    events = Queue("celeryev.monitor", Exchange("celeryev", "topic", durable=True), routing_key="#",
                   expires=60.0, auto_delete=True)
    events(monitor.default_channel).declare()
    app = Celery("sent-events", broker=f"durable+{broker_db}", set_as_current=False)
    celery_durable.install(app)
    app.conf.update(durable_database_url=broker_db, task_send_sent_event=True)

    @app.task(name="fanout.noop", shared=False)
    def noop() -> None:
        return None

    user = sa.create_engine(broker_db)
    with user.begin() as conn:
        conn.execute(sa.text("CREATE TABLE fanout_orders (id INTEGER)"))
    try:
        with user.begin() as conn:
            conn.execute(sa.text("INSERT INTO fanout_orders VALUES (1)"))  # the caller holds the write lock
            sent = outbox.enqueue(conn, noop.s())
            assert _rows(broker_db) == []  # nothing visible before the commit
        assert sorted(_rows(broker_db)) == ["celery", "celeryev.monitor"]
        event = _body(monitor, events)
        assert (event["type"], event["uuid"]) == ("task-sent", sent.id)
    finally:
        user.dispose()
        app.close()


def test_a_queue_first_declared_by_a_send_inside_a_write_transaction_binds_in_it(connect, broker_db):
    """A send inside ``celery_durable.transaction`` to a queue bound under another key declares it there and
    then: the binding is written without waiting for the caller's write lock (SQLite's only one)."""
    from celery import Celery

    import celery_durable

    feed = Queue("feed", Exchange("media", "direct"), routing_key="media.video")
    app = Celery("bind-in-transaction", broker=f"durable+{broker_db}", set_as_current=False)
    celery_durable.install(app)
    app.conf.update(durable_database_url=broker_db)

    @app.task(name="fanout.encode", shared=False)
    def encode() -> None:
        return None

    user = sa.create_engine(broker_db)
    with user.begin() as conn:
        conn.execute(sa.text("CREATE TABLE fanout_videos (id INTEGER)"))
    try:
        with user.begin() as conn:
            conn.execute(sa.text("INSERT INTO fanout_videos VALUES (1)"))  # the caller holds the write lock
            with celery_durable.transaction(conn, app):
                encode.apply_async(queue=feed)
        assert _rows(broker_db) == ["feed"]
        assert _bindings(broker_db) == [("media", "media.video", "feed")]
        # Another process, which never declared the queue, routes by the recorded binding.
        other = connect()
        other.Producer().publish({"n": 2}, exchange=Exchange("media", "direct"), routing_key="media.video")
        assert _rows(broker_db) == ["feed", "feed"]
    finally:
        user.dispose()
        app.close()
