"""The broker's kept connection for claims, acks and renewals (broker/claim_connection.py), on real PostgreSQL:
what it answers, and what a consumer sees when the database goes away and comes back (the test's own proxy)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kombu.exceptions
import pytest
import sqlalchemy as sa
from kombu import Connection

from celery_durable.broker import register, rows
from celery_durable.broker.claim_connection import ClaimConnection
from celery_durable.broker.transport import Transport
from celery_durable.store.engine import ensure_schema, lazy_commit
from tests.faultproxy import FaultProxy
from tests.stores import fresh_store

pytestmark = pytest.mark.postgres


@pytest.fixture
def db_url(tmp_path: Path) -> Iterator[str]:
    with fresh_store("postgresql", tmp_path) as url:
        ensure_schema(url)
        yield url


def _publish(url: str, queue: str, count: int) -> None:
    with ensure_schema(url).begin() as conn:
        rows.insert(conn, [rows.Outgoing(queue, {"properties": {}, "body": n}) for n in range(count)])


def test_claims_acks_and_renewals_answer_as_on_an_engine(db_url: str) -> None:
    _publish(db_url, "q", 3)
    hot = ClaimConnection(lazy_commit(ensure_schema(db_url)))
    seen: list[str] = []
    hot.listen(lambda statement, _params: seen.append(statement))
    try:
        taken = rows.claim(hot, "q", 2, "h", 30)
        assert [row.payload["body"] for row in taken] == [0, 1]
        assert rows.renew(hot, "h", 30) == 2
        assert rows.ack(hot, [taken[0].id], "someone else") == 0  # only the holder's own rows
        assert rows.ack(hot, [row.id for row in taken], "h") == 2
        ((ask),) = rows.claim_pass(hot, ["q"], [5], None, "h", 30)
        assert (ask.queue, ask.count, ask.taken, [m.payload["body"] for m in ask.claimed]) == ("q", 5, 1, [2])
        assert len(seen) == 5  # each call one statement
        # synchronous_commit off on this connection (a lazy_commit engine's), as the engine's claims had.
        found, _ = hot.execute("SHOW synchronous_commit", {})
        assert found == [("off",)]
    finally:
        hot.close()


def test_a_statement_error_names_the_statement_and_keeps_the_connection(db_url: str) -> None:
    hot = ClaimConnection(lazy_commit(ensure_schema(db_url)))
    try:
        with pytest.raises(sa.exc.ProgrammingError, match="no_such_table"):
            hot.execute("SELECT * FROM no_such_table", {})
        assert hot.execute("SELECT 1", {})[0] == [(1,)]
    finally:
        hot.close()


def test_a_database_gone_is_a_connection_error_of_the_transport_and_a_fresh_connection_after(
        db_url: str, fault_proxy: Callable[[str], FaultProxy]) -> None:
    proxy = fault_proxy(db_url)
    hot = ClaimConnection(lazy_commit(ensure_schema(proxy.url_for(db_url))))
    connection_errors = tuple(Transport.connection_errors)
    try:
        assert hot.execute("SELECT 1", {})[0] == [(1,)]
        proxy.outage()
        # The kept connection cut mid-life, then a new one refused: both are errors kombu reconnects on
        # (a bare driver error would stop the worker as "unrecoverable").
        errors: list[Any] = []
        for _ in range(2):
            with pytest.raises(sa.exc.OperationalError) as raised:
                hot.execute("SELECT 1", {})
            errors.append(raised.value)
        assert all(isinstance(err, connection_errors) for err in errors)
        assert all(err.connection_invalidated for err in errors)
        proxy.restore()
        assert hot.execute("SELECT 1", {})[0] == [(1,)]
    finally:
        hot.close()


def test_a_connect_while_the_database_is_away_fails_as_kombu_retries_it(
        db_url: str, fault_proxy: Callable[[str], FaultProxy]) -> None:
    # The schema is checked once per process and URL; a later connect must still reach the database,
    # or Celery's consumer starts on a broker it cannot reach and restarts in a tight loop.
    register()
    proxy = fault_proxy(db_url)
    url = f"durable+{proxy.url_for(db_url)}"
    with Connection(url) as first:
        first.connect()
    proxy.outage()
    with Connection(url) as second:
        with pytest.raises(tuple(Transport.connection_errors), match="Connection refused"):
            second.connect()
        # kombu's own OperationalError once its retries are spent: what Celery's consumer retries with its backoff.
        with pytest.raises(kombu.exceptions.OperationalError):
            second.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
    proxy.restore()
    with Connection(url) as third:
        third.connect()
        assert third.connected


def test_a_pass_over_queue_names_of_every_shape_reads_them_back_as_sent(db_url: str) -> None:
    # The pass sends its queues as one array literal (rows.text_array): a name with a quote, a
    # backslash, a comma, braces, spaces or the word NULL must reach the server as itself.
    names = ['plain', 'a"quote', 'back\\slash', 'com,ma', '{braces}', 'NULL', ' spaced ', 'ünï']
    hot = ClaimConnection(lazy_commit(ensure_schema(db_url)))
    try:
        found, _ = hot.execute("SELECT CAST(%(names)s AS text[])", {"names": rows.text_array(names)})
        assert found == [(names,)]
        for name in names:
            _publish(db_url, name, 1)
        asks = rows.claim_pass(hot, names, [1] * len(names), None, "h", 30)
        assert [ask.queue for ask in asks] == names
        assert all(ask.taken == 1 for ask in asks)
        assert rows.ack(hot, [row.id for ask in asks for row in ask.claimed], "h") == len(names)
    finally:
        hot.close()
