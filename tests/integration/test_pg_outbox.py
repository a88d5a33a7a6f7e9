"""outbox.enqueue and ``celery_durable.transaction()`` on the PostgreSQL broker: rows in the caller's transaction."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery, chain, group
from sqlalchemy.orm import Session

import celery_durable
from celery_durable import OutboxDatabaseMismatch, TransactionEnded, TransactionUnsupported, outbox
from celery_durable.broker import register
from celery_durable.store.engine import ensure_schema
from tests.services import broker_url
from tests.stores import fresh_store


@pytest.fixture
def db_url(tmp_path: Path) -> Iterator[str]:
    register()
    with fresh_store("postgresql", tmp_path) as url:
        ensure_schema(url)
        yield url


def make_app(db_url: str, **conf: Any) -> Celery:
    app = Celery(f"pg-outbox-{uuid.uuid4().hex[:6]}", broker=f"durable+{db_url}", set_as_current=False)
    app.conf.update(conf)

    @app.task(name="pgo.noop", shared=False)
    def noop(label: str) -> str:  # pragma: no cover - never run here: the tests read the rows
        return label

    return app


def message_rows(db_url: str) -> list[dict[str, Any]]:
    """Every broker row, oldest first: queue and the kombu message (its headers decoded)."""
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            found = conn.execute(sa.text("SELECT queue, payload FROM durable_broker_messages ORDER BY id")).all()
    finally:
        engine.dispose()
    return [{"queue": row.queue, **json.loads(row.payload)} for row in found]


def outbox_count(db_url: str) -> int:
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM durable_outbox")).scalar_one())
    finally:
        engine.dispose()


def task_rows(db_url: str) -> list[dict[str, Any]]:
    return [row for row in message_rows(db_url) if "task" in (row.get("headers") or {})]


def test_enqueue_commits_the_broker_row_itself_and_no_outbox_row(db_url: str) -> None:
    app = make_app(db_url)
    engine = sa.create_engine(db_url)
    with Session(engine) as session, session.begin():
        result = outbox.enqueue(session, app.tasks["pgo.noop"].s("x"), queue="work", priority=3)
        # Not visible to anyone else before the commit.
        assert task_rows(db_url) == []
    rows = task_rows(db_url)
    assert [(r["queue"], r["headers"]["id"], r["headers"]["task"]) for r in rows] == [
        ("work", result.id, "pgo.noop")]
    assert rows[0]["properties"]["priority"] == 3
    assert outbox_count(db_url) == 0
    engine.dispose()


def test_enqueue_rolled_back_leaves_nothing(db_url: str) -> None:
    app = make_app(db_url)
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        with conn.begin() as txn:
            outbox.enqueue(conn, app.tasks["pgo.noop"].s("x"))
            txn.rollback()
    assert message_rows(db_url) == [] and outbox_count(db_url) == 0
    engine.dispose()


def test_enqueue_builds_the_message_the_relay_would(db_url: str) -> None:
    # The same send path as the relay: the headers Celery's own send_task_message writes.
    app = make_app(db_url)
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        result = outbox.enqueue(conn, app.tasks["pgo.noop"].s("x"), countdown=30, expires=600,
                                headers={"tenant": "t1"})
    (row,) = task_rows(db_url)
    headers = row["headers"]
    assert headers["id"] == result.id and headers["root_id"] == result.id
    assert headers["eta"] is not None and headers["expires"] is not None
    assert headers["tenant"] == "t1" and headers["argsrepr"] == "['x']"
    assert row["queue"] == "celery"
    engine.dispose()


def test_a_chain_enqueued_is_its_first_step_carrying_the_rest(db_url: str) -> None:
    app = make_app(db_url)
    noop = app.tasks["pgo.noop"]
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        result = outbox.enqueue(conn, chain(noop.s("a"), noop.s("b"), noop.s("c")))
    (row,) = task_rows(db_url)
    assert result.parent is not None and result.parent.parent is not None
    assert row["headers"]["id"] == result.parent.parent.id
    engine.dispose()


def test_transaction_sends_delay_apply_async_chain_and_group_on_commit_only(db_url: str) -> None:
    app = make_app(db_url)
    noop = app.tasks["pgo.noop"]
    engine = sa.create_engine(db_url)
    with Session(engine) as session:
        with session.begin(), celery_durable.transaction(session, app):
            noop.delay("rolled back")
            session.rollback()
        assert task_rows(db_url) == []
        with session.begin():
            with celery_durable.transaction(session, app):
                a = noop.delay("one")
                b = noop.apply_async(("two",), queue="other")
                c = (noop.s("c1") | noop.s("c2")).apply_async()
                g = group(noop.s("g1"), noop.s("g2")).apply_async()
            assert task_rows(db_url) == []
    sent = {r["headers"]["id"]: r["queue"] for r in task_rows(db_url)}
    assert sent == {a.id: "celery", b.id: "other", c.parent.id: "celery",
                    g.results[0].id: "celery", g.results[1].id: "celery"}
    engine.dispose()


def test_outside_the_block_publishes_as_usual(db_url: str) -> None:
    app = make_app(db_url)
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        conn.begin()
        with celery_durable.transaction(conn, app):
            app.tasks["pgo.noop"].delay("inside")
        outside = app.tasks["pgo.noop"].delay("outside")
        conn.rollback()
    assert [r["headers"]["id"] for r in task_rows(db_url)] == [outside.id]
    engine.dispose()


def test_task_sent_events_never_leave_the_transaction(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Under task_send_sent_event Celery publishes the event through the same producer right after
    # the task: inside the block that publish is bound to the caller's transaction too, so no
    # event can announce a task that rolls back. (The transport routes no topic exchange yet,
    # issue 26, so the event itself reaches no row today.)
    from celery_durable.broker import in_transaction

    published: list[tuple[str, bool]] = []
    real_current = in_transaction.current

    def spying_current() -> Any:
        binding = real_current()
        published.append(("publish", binding is not None))
        return binding

    monkeypatch.setattr(in_transaction, "current", spying_current)
    sent: list[str] = []
    app = make_app(db_url, task_send_sent_event=True)
    from celery import signals

    def on_sent(sender: Any = None, **kwargs: Any) -> None:
        sent.append(str(kwargs.get("headers", {}).get("id")))

    signals.after_task_publish.connect(on_sent, weak=False)
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            with conn.begin() as txn, celery_durable.transaction(conn, app):
                app.tasks["pgo.noop"].delay("rolled back")
                outbox.enqueue(conn, app.tasks["pgo.noop"].s("rolled back too"))
                txn.rollback()
            assert message_rows(db_url) == []
            with conn.begin():
                kept = outbox.enqueue(conn, app.tasks["pgo.noop"].s("kept"))
    finally:
        signals.after_task_publish.disconnect(on_sent)
        engine.dispose()
    assert [r["headers"]["id"] for r in message_rows(db_url)] == [kept.id]
    assert len(sent) == 3
    assert published and all(bound for _, bound in published), published
def test_transaction_refuses_another_broker_naming_the_setting(db_url: str) -> None:
    app = Celery("redis-app", broker=broker_url("redis"), set_as_current=False)
    engine = sa.create_engine(db_url)
    with engine.connect() as conn, pytest.raises(TransactionUnsupported) as refused:
        with celery_durable.transaction(conn, app):
            pass  # pragma: no cover - refused on entry
    assert refused.value.setting == "broker_url" and "outbox.enqueue" in str(refused.value)
    engine.dispose()


def test_transaction_refuses_a_connection_on_another_database(db_url: str, tmp_path: Path) -> None:
    app = make_app(db_url)
    with fresh_store("postgresql", tmp_path) as other:
        engine = sa.create_engine(other)
        with engine.connect() as conn, pytest.raises(OutboxDatabaseMismatch):
            with celery_durable.transaction(conn, app):
                pass  # pragma: no cover - refused on entry
        engine.dispose()


def test_enqueue_on_redis_keeps_the_outbox_row(db_url: str) -> None:
    app = Celery("redis-app", broker=broker_url("redis"), set_as_current=False)
    app.conf.durable_database_url = db_url
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        outbox.enqueue(conn, app.signature("pgo.noop", ("x",)))
    assert outbox_count(db_url) == 1 and message_rows(db_url) == []
    engine.dispose()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["enqueue", "transaction"])
def test_the_first_send_on_a_fresh_database_inside_a_transaction_that_already_wrote(tmp_path: Path, how: str) -> None:
    # Before: the schema was made in the caller's transaction, and the producer's broker connection,
    # checking it on a connection of its own, waited on the caller's locks while the caller waited on it.
    register()
    with fresh_store("postgresql", tmp_path) as url:
        app = make_app(url)
        engine = sa.create_engine(url)
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql("CREATE TABLE user_orders (id int)")
                conn.exec_driver_sql("INSERT INTO user_orders VALUES (1)")
                if how == "enqueue":
                    sent = outbox.enqueue(conn, app.tasks["pgo.noop"].s("first")).id
                else:
                    with celery_durable.transaction(conn, app):
                        sent = app.tasks["pgo.noop"].delay("first").id
            assert [r["headers"]["id"] for r in task_rows(url)] == [sent]
        finally:
            engine.dispose()


def test_sends_are_one_insert_seen_by_the_transaction_and_follow_its_savepoints(db_url: str) -> None:
    app = make_app(db_url)
    noop = app.tasks["pgo.noop"]
    statements: list[str] = []
    engine = sa.create_engine(db_url)
    sa.event.listen(engine, "before_cursor_execute",
                    lambda conn, cursor, statement, *a: statements.append(statement))
    with engine.connect() as conn:
        with conn.begin():
            kept = [outbox.enqueue(conn, noop.s(f"a{i}")).id for i in range(5)]
            # The caller's own next statement sees them (inserted just before it, in one statement).
            inserts_before = sum("INSERT INTO durable_broker_messages" in s for s in statements)
            seen = conn.execute(sa.text("SELECT count(*) FROM durable_broker_messages")).scalar_one()
            inserts = sum("INSERT INTO durable_broker_messages" in s for s in statements) - inserts_before
            assert (seen, inserts) == (5, 1)
            nested = conn.begin_nested()
            outbox.enqueue(conn, noop.s("rolled back to the savepoint"))
            with celery_durable.transaction(conn, app):
                noop.delay("this one too")
            nested.rollback()
            kept.append(outbox.enqueue(conn, noop.s("after")).id)
        # Rolled back: what was sent in it must not reach the next transaction on this connection.
        with conn.begin() as txn:
            outbox.enqueue(conn, noop.s("rolled back"))
            txn.rollback()
        with conn.begin():
            conn.execute(sa.text("SELECT 1"))
    assert [r["headers"]["id"] for r in task_rows(db_url)] == kept
    engine.dispose()


def test_a_session_commit_with_nothing_else_to_flush_still_inserts(db_url: str) -> None:
    app = make_app(db_url)
    engine = sa.create_engine(db_url)
    with Session(engine) as session:
        with session.begin():
            with celery_durable.transaction(session, app):
                sent = [app.tasks["pgo.noop"].delay(f"s{i}").id for i in range(3)]
        with session.begin():
            nested = session.begin_nested()
            outbox.enqueue(session, app.tasks["pgo.noop"].s("savepoint"))
            nested.rollback()
    assert [r["headers"]["id"] for r in task_rows(db_url)] == sent
    engine.dispose()


def _senders_channels() -> list[Any]:
    from celery_durable.outbox.publishing import direct

    return list(direct._senders.keys())


def test_routes_declared_once_per_channel_still_route_after_the_producer_reconnects(db_url: str) -> None:
    app = make_app(db_url)
    noop = app.tasks["pgo.noop"]
    engine = sa.create_engine(db_url)
    expected = []
    channels: list[set[int]] = []
    for round_ in range(3):
        with engine.begin() as conn:
            for queue in ("one", "two", "one"):
                expected.append((queue, outbox.enqueue(conn, noop.s(f"{round_}"), queue=queue).id))
        # The pooled broker connection closed (as after a lost database): the next enqueue's producer
        # reconnects, on a new channel that has declared nothing yet.
        before = set(map(id, _senders_channels()))
        with app.producer_or_acquire() as producer:
            producer.connection.close()
        channels.append(before)
    assert [(r["queue"], r["headers"]["id"]) for r in task_rows(db_url)] == expected
    assert len(set().union(*channels)) >= 2, "the producer never got a new channel"
    engine.dispose()


def test_an_insert_failing_at_commit_fails_the_commit_and_keeps_nothing(db_url: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_durable.broker import rows

    app = make_app(db_url)
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE user_orders (id int)")

    def failing(conn: Any, messages: Any) -> None:
        raise sa.exc.OperationalError("INSERT", {}, Exception("connection lost"))

    monkeypatch.setattr(rows, "insert", failing)
    with pytest.raises(sa.exc.OperationalError), engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO user_orders VALUES (1)")
        outbox.enqueue(conn, app.tasks["pgo.noop"].s("lost"))
    monkeypatch.undo()
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM user_orders").scalar_one() == 0
    assert message_rows(db_url) == []
    engine.dispose()


def test_a_commit_inside_the_block_neither_loses_nor_leaks_later_sends(db_url: str) -> None:
    app = make_app(db_url)
    noop = app.tasks["pgo.noop"]
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        conn.begin()
        with celery_durable.transaction(conn, app):
            first = noop.delay("first").id
            conn.commit()
            # The connection's next transaction (begun by the insert), sent when that one commits.
            second = noop.delay("second").id
            assert [r["headers"]["id"] for r in task_rows(db_url)] == [first]
            conn.commit()
    assert [r["headers"]["id"] for r in task_rows(db_url)] == [first, second]
    with Session(engine) as session:
        with pytest.raises(TransactionEnded), celery_durable.transaction(session, app):
            session.commit()  # gives the session's connection back
            noop.delay("after the session let go of its connection")
    assert len(task_rows(db_url)) == 2
    engine.dispose()
