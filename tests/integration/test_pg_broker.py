"""The PostgreSQL broker on a real PostgreSQL: publish, claim, ack, requeue in place, leases, delays, priority."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kombu import Connection, Exchange, Queue

from celery_durable.broker import register, rows
from celery_durable.broker.backend import PgRows
from celery_durable.compat.virtual_rows import DELAY_HEADER
from celery_durable.store.engine import ensure_schema
from tests.stores import fresh_store

TTL = 1.5


@pytest.fixture
def db_url(tmp_path: Path) -> Iterator[str]:
    """An empty store on PostgreSQL (a schema of its own), migrated."""
    with fresh_store("postgresql", tmp_path) as url:
        ensure_schema(url)
        yield url


@pytest.fixture
def conn(db_url: str) -> Iterator[Connection]:
    register()
    with Connection(f"durable+{db_url}", transport_options={"durable_lease_ttl": TTL}) as connection:
        yield connection


def _queue(name: str = "q") -> Queue:
    return Queue(name, Exchange(name), name)


def _publish(conn: Connection, body: Any, queue: str = "q", **kwargs: Any) -> None:
    q = _queue(queue)
    conn.Producer().publish(body, exchange=q.exchange, routing_key=queue, declare=[q], **kwargs)


def _get(conn: Connection, queue: str = "q") -> Any:
    return _queue(queue)(conn.default_channel).get()


def _until(condition: Any, deadline: float, step: float = 0.05) -> Any:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        found = condition()
        if found:
            return found
        time.sleep(step)
    return condition()


def _count(db_url: str) -> int:
    with ensure_schema(db_url).connect() as c:
        return int(c.exec_driver_sql("SELECT count(*) FROM durable_broker_messages").scalar() or 0)


def test_publish_claim_ack(conn: Connection, db_url: str) -> None:
    _publish(conn, {"n": 1})
    message = _get(conn)
    assert message.payload == {"n": 1}
    assert message.delivery_info["redelivered"] is False
    assert _get(conn) is None  # held: not handed out again
    message.ack()
    # Acks are deleted in batches, at the latest before the connection's next claim, idle wait or heartbeat.
    assert _get(conn) is None
    assert _count(db_url) == 0


def test_acks_are_one_delete_per_batch(conn: Connection, db_url: str) -> None:
    for n in range(20):
        _publish(conn, n)
    deleting: list[Any] = []

    def seen(statement: str, parameters: Any) -> None:
        # A DELETE of its own, or a claim carrying the acks since the last statement (durable_broker_claim
        # deletes them first, in the same call).
        # (acked ids travel as one array literal: "{}" carries none.)
        if "DELETE FROM durable_broker_messages" in statement or (isinstance(parameters, dict)
                                                                  and parameters.get("acked") not in (None, "{}")):
            deleting.append(parameters)

    # Claims and acks go to the driver on the consumer's kept connection (broker/claim_connection.py).
    conn.transport.rows.hot.listen(seen)
    with conn.Consumer(_queue(), callbacks=[lambda body, m: m.ack()], prefetch_count=20):
        conn.drain_events(timeout=5)
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.2)
    assert _count(db_url) == 0
    assert len(deleting) == 1  # one statement deletes the batch of 20


def test_a_batch_publish_is_one_statement(conn: Connection, db_url: str) -> None:
    channel = conn.default_channel
    _queue()(channel).declare()
    statements: list[str] = []
    engine = conn.transport.rows.engine
    sa.event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    messages = [channel.prepare_message(channel.encode_body(f'"{i}"')[0]) for i in range(50)]
    channel.basic_publish_many(messages, "q", "q")
    assert sum("INSERT INTO durable_broker_messages" in s for s in statements) == 1
    assert _count(db_url) == 50


def test_requeue_puts_the_row_back_in_its_place_marked_redelivered(conn: Connection) -> None:
    for n in range(3):
        _publish(conn, n)
    first = _get(conn)
    assert first.payload == 0
    first.reject(requeue=True)
    again = _get(conn)
    assert again.payload == 0
    assert again.delivery_info["redelivered"] is True
    assert _get(conn).payload == 1


def test_higher_priority_first_then_oldest_first(conn: Connection) -> None:
    for body, priority in (("a0", 0), ("b9", 9), ("c5", 5), ("d9", 9)):
        _publish(conn, body, priority=priority)
    assert [_get(conn).payload for _ in range(4)] == ["b9", "d9", "c5", "a0"]


def test_a_delayed_row_is_invisible_until_its_time_in_the_databases_clock(conn: Connection) -> None:
    sent = time.monotonic()
    _publish(conn, "later", headers={DELAY_HEADER: 800})
    assert _get(conn) is None
    message = _until(lambda: _get(conn), deadline=5)
    assert message.payload == "later"
    assert time.monotonic() - sent >= 0.75


def test_a_lapsed_lease_hands_the_row_out_again_and_a_renewed_one_never(db_url: str) -> None:
    engine = ensure_schema(db_url)
    with engine.begin() as c:
        rows.insert(c, [rows.Outgoing("q", {"properties": {}, "body": "x"})])
    (taken,) = rows.claim(engine, "q", 10, "dead-holder", 0.5)
    assert rows.claim(engine, "q", 10, "other", 0.5) == []
    back = _until(lambda: rows.claim(engine, "q", 10, "other", 30), deadline=5)
    assert [r.id for r in back] == [taken.id] and back[0].delivery_count == 2
    # A live holder (renewing every TTL/3) keeps its row past several TTLs.
    live = PgRows(db_url, lease_ttl=0.6)
    try:
        with engine.begin() as c:
            rows.insert(c, [rows.Outgoing("r", {"properties": {}, "body": "y"})])
        assert len(live.claim("r", 1)) == 1
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            assert rows.claim(engine, "r", 10, "thief", 30) == []
            time.sleep(0.1)
    finally:
        live.close()


def test_skip_locked_two_consumers_never_share_a_row_nor_wait(db_url: str) -> None:
    engine = ensure_schema(db_url)
    with engine.begin() as c:
        rows.insert(c, [rows.Outgoing("q", {"properties": {}, "body": i}) for i in range(200)])
    # A transaction holding the oldest row's lock: the claims skip it instead of waiting.
    blocker = engine.connect()
    tx = blocker.begin()
    blocker.exec_driver_sql("SELECT id FROM durable_broker_messages ORDER BY id LIMIT 1 FOR UPDATE")
    taken: dict[str, list[int]] = {"a": [], "b": []}

    def consume(holder: str) -> None:
        while True:
            got = rows.claim(engine, "q", 7, holder, 30)
            if not got:
                return
            taken[holder].extend(r.id for r in got)

    threads = [threading.Thread(target=consume, args=(h,)) for h in taken]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    tx.rollback()
    blocker.close()
    assert not set(taken["a"]) & set(taken["b"])
    assert len(taken["a"]) + len(taken["b"]) == 199


def test_an_idle_consumer_is_woken_by_notify_not_a_poll(conn: Connection, db_url: str) -> None:
    got: list[float] = []
    conn.transport.polling_interval = 10.0  # only a NOTIFY can wake it in time
    consumer = conn.Consumer(_queue(), callbacks=[lambda body, m: (got.append(time.monotonic()), m.ack())])
    consumer.consume()
    sent: list[float] = []

    def publish_later() -> None:
        time.sleep(0.3)
        register()
        with Connection(f"durable+{db_url}") as producer:
            sent.append(time.monotonic())
            _publish(producer, "wake")

    thread = threading.Thread(target=publish_later)
    thread.start()
    conn.drain_events(timeout=5)
    thread.join()
    consumer.cancel()
    assert got and got[0] - sent[0] < 0.5


KILLED_HOLDER = textwrap.dedent("""
    import sys, time
    from kombu import Connection, Exchange, Queue
    from celery_durable.broker import register
    register()
    with Connection("durable+" + sys.argv[1], transport_options={"durable_lease_ttl": float(sys.argv[2])}) as c:
        q = Queue("q", Exchange("q"), "q")(c.default_channel)
        held = [q.get() for _ in range(3)]
        print(",".join(str(m.payload) for m in held), flush=True)
        time.sleep(600)
""")


def test_a_sigkilled_holders_rows_come_back_in_place_one_ttl_later(conn: Connection, db_url: str) -> None:
    for n in range(5):
        _publish(conn, n)
    child = subprocess.Popen([sys.executable, "-c", KILLED_HOLDER, db_url, str(TTL)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "0,1,2"
        time.sleep(TTL)  # the child's heartbeat renewed the leases past one TTL at least once
        os.kill(child.pid, signal.SIGKILL)
        killed = time.monotonic()
    finally:
        child.kill()
        child.wait()
    assert [_get(conn).payload for _ in range(2)] == [3, 4]
    assert _get(conn) is None  # the dead holder's rows are not handed out before their lease lapses
    back = _until(lambda: _get(conn), deadline=TTL * 3)
    waited = time.monotonic() - killed
    rest = [_get(conn) for _ in range(2)]
    assert [m.payload for m in [back, *rest]] == [0, 1, 2]  # in their original order
    assert all(m.delivery_info["redelivered"] for m in [back, *rest])
    assert waited <= TTL + 1.0


def test_a_forked_child_never_gives_back_or_acks_its_parents_rows(conn: Connection, db_url: str) -> None:
    # billiard runs inherited finalizers when a pool child exits; kombu's restores a channel's unacked.
    _publish(conn, "held")
    message = _get(conn)
    pid = os.fork()
    if pid == 0:
        try:
            conn.transport.rows.give_back(message.delivery_tag)
            conn.transport.rows.ack(message.delivery_tag)
            conn.transport.rows.flush_acks()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert _get(conn) is None  # still held by the parent
    assert _count(db_url) == 1


@pytest.mark.parametrize("bad", ["not json", '"a string"', '{"body": "no properties"}'])
def test_a_row_that_is_not_a_kombu_message_is_parked_and_the_rest_delivered(conn: Connection, db_url: str,
                                                                            bad: str) -> None:
    _publish(conn, "before")
    with ensure_schema(db_url).begin() as c:
        c.execute(sa.text("INSERT INTO durable_broker_messages (queue, payload) VALUES ('q', :p)"), {"p": bad})
    _publish(conn, "after")
    got = []
    with conn.Consumer(_queue(), callbacks=[lambda body, m: (got.append(body), m.ack())], prefetch_count=10):
        conn.drain_events(timeout=5)
    assert got == ["before", "after"]
    with ensure_schema(db_url).connect() as c:
        parked = c.execute(sa.text("SELECT queue, payload, holder FROM durable_broker_messages "
                                   "WHERE queue <> 'q'")).all()
    assert [tuple(r) for r in parked] == [("q.durable.parked", bad, None)]


def test_an_unreachable_database_is_kombus_connection_error() -> None:
    from kombu.exceptions import OperationalError

    register()
    # A port nothing listens on: refused at once.
    with Connection("durable+postgresql://postgres@127.0.0.1:9/test?connect_timeout=2") as conn:
        # connect() raises the transport's own connection error (as redis-py's on Redis); the retrying
        # paths (Celery's publish retry, the consumer's reconnect) catch exactly these.
        with pytest.raises(conn.connection_errors):
            conn.connect()
        with pytest.raises(OperationalError):
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0)


def test_celerys_publish_to_an_unreachable_database_raises_kombus_operational_error() -> None:
    from celery import Celery
    from kombu.exceptions import OperationalError

    register()
    app = Celery("unreachable", broker="durable+postgresql://postgres@127.0.0.1:9/test", set_as_current=False)
    with pytest.raises(OperationalError):
        app.send_task("anything", retry=False)
    app.close()


def _planned(queues: list[str], ready: dict[str, int], free: dict[str, int], room: int | None
             ) -> list[tuple[str, int, int]]:
    """The pure sweep's asks that take something, given how many rows each queue has ready."""
    from celery_durable.planning.claim_sweep import begin_sweep, next_ask, record

    left = dict(ready)
    sweep = begin_sweep(queues, free, room, None)
    asks = []
    while True:
        ask, sweep = next_ask(sweep)
        if ask is None:
            return asks
        got = min(ask.count, left[ask.queue])
        left[ask.queue] -= got
        sweep = record(sweep, ask, got)
        if got:
            asks.append((ask.queue, ask.count, got))


@pytest.mark.parametrize(("ready", "free", "room"), [
    ({"a": 5, "b": 5, "c": 5}, {"a": 8, "b": 8, "c": 8}, 1),
    ({"a": 5, "b": 5, "c": 5}, {"a": 8, "b": 8, "c": 8}, 7),
    ({"a": 9, "b": 0, "c": 1}, {"a": 8, "b": 8, "c": 8}, 6),
    ({"a": 3, "b": 3, "c": 3}, {"a": 2, "b": 1, "c": 8}, None),
    ({"a": 20, "b": 2, "c": 20}, {"a": 4, "b": 4, "c": 4}, 10),
    ({"a": 0, "b": 0, "c": 0}, {"a": 4, "b": 4, "c": 4}, 10),
    ({"a": 4, "b": 4, "c": 4}, {"a": 0, "b": 4, "c": 4}, 0),
])
def test_a_whole_pass_is_one_statement_that_asks_as_the_pure_sweep_plans(
        db_url: str, ready: dict[str, int], free: dict[str, int], room: int | None) -> None:
    engine = ensure_schema(db_url)
    with engine.begin() as c:
        rows.insert(c, [rows.Outgoing(q, {"properties": {}, "body": f"{q}{i}"})
                        for i in range(max(ready.values())) for q in ready if i < ready[q]])
    statements: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    queues = list(ready)
    asks = rows.claim_pass(engine, queues, [free[q] for q in queues], room, "h", 30)
    assert len(statements) == 1
    assert [(a.queue, a.count, a.taken) for a in asks] == _planned(queues, ready, free, room)
    for ask in asks:  # each ask's rows oldest first
        assert [c.payload["body"] for c in ask.claimed] == sorted((c.payload["body"] for c in ask.claimed),
                                                                  key=lambda b: int(b[1:]))


def test_a_pass_deletes_the_holders_acks_in_the_same_statement(db_url: str) -> None:
    backend = PgRows(db_url, lease_ttl=30)
    try:
        with backend.engine.begin() as c:
            rows.insert(c, [rows.Outgoing("q", {"properties": {}, "body": i}) for i in range(3)])
        ((queue, count, taken, payloads),) = backend.claim_pass(["q"], [2], None)
        assert (queue, count, taken) == ("q", 2, 2)
        for payload in payloads:
            backend.ack(payload["properties"]["delivery_tag"])
        statements: list[str] = []

        def on_engine(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
            statements.append(statement)

        # Every statement, whichever way it goes: any engine's and the kept connection's.
        sa.event.listen(sa.engine.Engine, "before_cursor_execute", on_engine)
        backend.hot.listen(lambda statement, _params: statements.append(statement))
        try:
            ((_, _, taken, _),) = backend.claim_pass(["q"], [2], None)
        finally:
            sa.event.remove(sa.engine.Engine, "before_cursor_execute", on_engine)
        assert taken == 1
        assert len(statements) == 1
        assert _count(db_url) == 1  # the two acked rows deleted, the third held
    finally:
        backend.close()
