"""The broker on SQLite (``durable+sqlite:///file``): the PostgreSQL broker's rules with one writer and a poll."""

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

from celery_durable.broker import register, rows, sqlite_rows
from celery_durable.broker.sqlite_backend import SQLITE_POLLING_INTERVAL, SqliteRows
from celery_durable.compat.virtual_rows import DELAY_HEADER
from celery_durable.store.engine import autocommit, ensure_schema

TTL = 1.5


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'broker.sqlite'}"
    ensure_schema(url)
    return url


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


def _until(condition: Any, deadline: float, step: float = 0.02) -> Any:
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


def _outgoing(queue: str, body: Any) -> rows.Outgoing:
    return rows.Outgoing(queue, {"properties": {}, "body": body})


def _insert(db_url: str, messages: list[rows.Outgoing]) -> None:
    with ensure_schema(db_url).begin() as c:
        sqlite_rows.insert(c, messages)


def test_the_transport_on_sqlite_is_this_broker_and_polls_for_other_processes_rows(conn: Connection) -> None:
    assert isinstance(conn.transport.rows, SqliteRows)
    assert conn.transport.polling_interval == SQLITE_POLLING_INTERVAL


def test_publish_claim_ack(conn: Connection, db_url: str) -> None:
    _publish(conn, {"n": 1})
    message = _get(conn)
    assert message.payload == {"n": 1}
    assert message.delivery_info["redelivered"] is False
    assert _get(conn) is None  # held: not handed out again
    message.ack()
    assert _get(conn) is None  # the claim deletes the acked row first
    assert _count(db_url) == 0


def test_requeue_puts_the_row_back_in_its_place_marked_redelivered(conn: Connection) -> None:
    for n in range(3):
        _publish(conn, n)
    first = _get(conn)
    assert first.payload == 0
    first.reject(requeue=True)
    again = _get(conn)
    assert (again.payload, again.delivery_info["redelivered"]) == (0, True)
    assert _get(conn).payload == 1


def test_higher_priority_first_then_oldest_first(conn: Connection) -> None:
    for body, priority in (("a0", 0), ("b9", 9), ("c5", 5), ("d9", 9)):
        _publish(conn, body, priority=priority)
    assert [_get(conn).payload for _ in range(4)] == ["b9", "d9", "c5", "a0"]


def test_a_delayed_row_is_invisible_until_its_time(conn: Connection) -> None:
    sent = time.monotonic()
    _publish(conn, "later", headers={DELAY_HEADER: 800})
    assert _get(conn) is None
    message = _until(lambda: _get(conn), deadline=5)
    assert message.payload == "later"
    assert time.monotonic() - sent >= 0.75


def test_a_lapsed_lease_hands_the_row_out_again_counting_a_lapse_and_a_renewed_one_never(db_url: str) -> None:
    engine = ensure_schema(db_url)
    _insert(db_url, [_outgoing("q", "x")])
    (taken,) = sqlite_rows.claim(engine, "q", 10, "dead-holder", 0.5)
    assert sqlite_rows.claim(engine, "q", 10, "other", 0.5) == []
    back = _until(lambda: sqlite_rows.claim(engine, "q", 10, "other", 30), deadline=5)
    assert [(r.id, r.delivery_count, r.lapses) for r in back] == [(taken.id, 2, 1)]
    live = SqliteRows(db_url, lease_ttl=0.6)  # its heartbeat renews every TTL / 3
    try:
        _insert(db_url, [_outgoing("r", "y")])
        assert len(live.claim("r", 1)) == 1
        deadline = time.monotonic() + 2.5  # four TTLs
        while time.monotonic() < deadline:
            assert sqlite_rows.claim(engine, "r", 10, "thief", 30) == []
            time.sleep(0.1)
    finally:
        live.close()


def test_a_poll_that_finds_nothing_takes_no_write_lock(db_url: str) -> None:
    engine = ensure_schema(db_url)
    statements: list[str] = []
    for pool in (engine, autocommit(engine)):  # autocommit statements run on a pool of their own
        sa.event.listen(pool, "before_cursor_execute", lambda *a: statements.append(a[2]))
    assert sqlite_rows.claim(engine, "q", 10, "h", 30) == []
    assert sqlite_rows.claim_pass(engine, ["a", "b", "c"], [4, 4, 4], 8, "h", 30) == []
    assert statements and all(s.lstrip().startswith("SELECT") for s in statements)
    assert not any("BEGIN" in s for s in statements)


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


def test_two_processes_claiming_one_queue_never_share_a_row(db_url: str) -> None:
    _insert(db_url, [_outgoing("q", i) for i in range(300)])
    script = textwrap.dedent("""
        import sys
        from celery_durable.broker import sqlite_rows
        from celery_durable.store.engine import autocommit, ensure_schema
        engine = ensure_schema(sys.argv[1])
        taken = []
        while True:
            got = sqlite_rows.claim(engine, "q", 7, sys.argv[2], 30)
            if not got:
                break
            taken += [r.id for r in got]
        print(",".join(map(str, taken)))
    """)
    children = [subprocess.Popen([sys.executable, "-c", script, db_url, holder], stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONPATH": os.getcwd()}) for holder in ("a", "b")]
    outputs = [child.communicate(timeout=60)[0].strip() for child in children]
    taken = [[int(i) for i in out.split(",") if i] for out in outputs]
    assert not set(taken[0]) & set(taken[1])
    assert len(taken[0]) + len(taken[1]) == 300


def test_an_idle_consumer_hears_of_another_processs_row_within_the_poll(conn: Connection, db_url: str) -> None:
    got: list[float] = []
    consumer = conn.Consumer(_queue(), callbacks=[lambda body, m: (got.append(time.monotonic()), m.ack())])
    consumer.consume()
    sent: list[float] = []

    def publish_later() -> None:
        time.sleep(0.3)
        with Connection(f"durable+{db_url}") as producer:
            sent.append(time.monotonic())
            _publish(producer, "wake")

    thread = threading.Thread(target=publish_later)
    thread.start()
    conn.drain_events(timeout=5)
    thread.join()
    consumer.cancel()
    assert got and got[0] - sent[0] < SQLITE_POLLING_INTERVAL + 0.2


@pytest.mark.parametrize("bad", ["not json", '"a string"', '{"body": "no properties"}'])
def test_a_row_that_is_not_a_kombu_message_is_parked_and_the_rest_delivered(conn: Connection, db_url: str,
                                                                            bad: str) -> None:
    _publish(conn, "before")
    with ensure_schema(db_url).begin() as c:
        c.execute(sa.text("INSERT INTO durable_broker_messages (queue, payload, visible_at) "
                          "VALUES ('q', :p, '2000-01-01 00:00:00.000000')"), {"p": bad})
    _publish(conn, "after")
    got = []
    with conn.Consumer(_queue(), callbacks=[lambda body, m: (got.append(body), m.ack())], prefetch_count=10):
        conn.drain_events(timeout=5)
    assert got == ["before", "after"]
    with ensure_schema(db_url).connect() as c:
        parked = c.execute(sa.text("SELECT queue, payload, holder FROM durable_broker_messages "
                                   "WHERE queue <> 'q'")).all()
    assert [tuple(r) for r in parked] == [("q.durable.parked", bad, None)]


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
def test_a_whole_pass_is_one_write_transaction_that_asks_as_the_pure_sweep_plans(
        db_url: str, ready: dict[str, int], free: dict[str, int], room: int | None) -> None:
    _insert(db_url, [_outgoing(q, f"{q}{i}") for i in range(max(ready.values())) for q in ready if i < ready[q]])
    engine = ensure_schema(db_url)
    statements: list[str] = []
    for pool in (engine, autocommit(engine)):
        sa.event.listen(pool, "before_cursor_execute", lambda *a: statements.append(a[2]))
    queues = list(ready)
    asks = sqlite_rows.claim_pass(engine, queues, [free[q] for q in queues], room, "h", 30)
    assert sum(s.startswith("BEGIN") for s in statements) <= 1
    assert [(a.queue, a.count, a.taken) for a in asks] == _planned(queues, ready, free, room)
    for ask in asks:  # each ask's rows oldest first
        assert [c.payload["body"] for c in ask.claimed] == sorted((c.payload["body"] for c in ask.claimed),
                                                                  key=lambda b: int(b[1:]))
