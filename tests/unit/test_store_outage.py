"""The outage tracker: one warning when a store goes out, one when it is back, each failing call at debug;
a failure that is not the store being away (a bug, a bad statement) is logged loudly every time."""

from __future__ import annotations

import logging
import uuid

import pytest
import sqlalchemy as sa

from celery_durable import shared_dir
from celery_durable.errors import StoreUnavailable
from celery_durable.store import outage
from celery_durable.store.notify import Waker
from celery_durable.store.unreachable import is_unreachable, only_dropped


def refused() -> sa.exc.OperationalError:
    return sa.exc.OperationalError("SELECT 1", None, Exception('connection to server failed: Connection refused'))


def dropped() -> sa.exc.OperationalError:
    return sa.exc.OperationalError("SELECT 1", None, Exception("server closed the connection unexpectedly"),
                                   connection_invalidated=True)


def unavailable(cause: sa.exc.DBAPIError) -> StoreUnavailable:
    try:
        raise StoreUnavailable("the durable store is unavailable") from cause
    except StoreUnavailable as err:
        return err


@pytest.fixture
def url(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delenv(shared_dir.ENV_VAR, raising=False)  # this process alone: no marker file
    return f"postgresql://u@db.invalid/{uuid.uuid4().hex}"


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "celery_durable.store" and r.levelno == level]


def test_an_outage_is_one_warning_each_way_and_every_failing_call_a_debug_line(url, caplog):
    caplog.set_level(logging.DEBUG, logger="celery_durable.store")
    for event in ("durable.lease.renew_failed", "durable.limit.dispatch_failed", "durable.relay.listen_failed"):
        outage.failed(url, refused(), event, level=logging.WARNING)
    outage.failed(url, unavailable(refused()), "durable.run.store_failed")
    assert url in outage._down
    outage.available(url)
    outage.available(url)
    warnings = records(caplog, logging.WARNING)
    assert [r.event for r in warnings] == ["durable.store.unavailable", "durable.store.available"]
    assert warnings[0].exc_info is None and "Connection refused" in warnings[0].getMessage()
    assert "lasted=" in warnings[1].getMessage() and warnings[1].lasted >= 0
    debug = records(caplog, logging.DEBUG)
    assert [r.event for r in debug] == ["durable.lease.renew_failed", "durable.limit.dispatch_failed",
                                        "durable.relay.listen_failed", "durable.run.store_failed"]
    assert all(r.exc_info for r in debug), "each failing call keeps its traceback, at debug"
    assert url not in outage._down


def test_a_failure_that_is_not_an_outage_is_logged_loudly_every_time(url, caplog):
    caplog.set_level(logging.DEBUG, logger="celery_durable.store")
    bad = sa.exc.ProgrammingError("SELECT nope", None, Exception('column "nope" does not exist'))
    outage.failed(url, bad, "durable.limit.dispatch_failed", level=logging.WARNING)
    outage.failed(url, KeyError("a bug"), "durable.lease.renew_failed")
    assert [(r.levelno, r.event) for r in caplog.records] == [
        (logging.WARNING, "durable.limit.dispatch_failed"), (logging.ERROR, "durable.lease.renew_failed")]
    assert all(r.exc_info for r in caplog.records)
    assert url not in outage._down


def test_a_connection_found_dead_is_no_outage_until_a_fresh_one_fails_too(url, caplog):
    """After a database restart every pooled connection fails once, in every process, with the store back."""
    caplog.set_level(logging.DEBUG, logger="celery_durable.store")
    outage.failed(url, dropped(), "durable.lease.renew_failed")
    outage.failed(url, unavailable(dropped()), "durable.run.store_failed")
    outage.available(url)
    assert records(caplog, logging.WARNING) == []
    outage.failed(url, dropped(), "durable.lease.renew_failed")
    outage.failed(url, refused(), "durable.lease.renew_failed")
    outage.available(url)
    assert [r.event for r in records(caplog, logging.WARNING)] == ["durable.store.unavailable",
                                                                    "durable.store.available"]


def test_the_workers_processes_say_it_once_between_them(url, caplog, monkeypatch, tmp_path):
    caplog.set_level(logging.WARNING, logger="celery_durable.store")
    monkeypatch.setenv(shared_dir.ENV_VAR, str(tmp_path))
    outage.failed(url, refused(), "durable.lease.renew_failed")
    # Another process of the worker (its own state, the same marker) meets the same outage.
    monkeypatch.setattr(outage, "_down", set())
    monkeypatch.setattr(outage, "_failing_since", {})
    outage.failed(url, refused(), "durable.run.store_failed")
    outage.available(url)
    assert [r.event for r in records(caplog, logging.WARNING)] == ["durable.store.unavailable",
                                                                    "durable.store.available"]
    assert list(tmp_path.iterdir()) == []


def test_what_counts_as_the_store_being_away():
    assert is_unreachable(refused()) and is_unreachable(dropped()) and is_unreachable(unavailable(refused()))
    assert is_unreachable(sa.exc.InterfaceError("SELECT 1", None, Exception("connection already closed")))
    assert not is_unreachable(sa.exc.IntegrityError("INSERT", None, Exception("duplicate key")))
    assert not is_unreachable(ValueError("a bug"))
    assert only_dropped(dropped()) and only_dropped(unavailable(dropped()))
    assert not only_dropped(refused()) and not only_dropped(unavailable(refused()))


def test_a_listen_that_cannot_connect_is_reported_to_its_owner_as_sqlalchemy_classifies_it():
    # Port 1 on the loopback: nothing listens, the connection is refused at once.
    engine = sa.create_engine("postgresql+psycopg2://u@127.0.0.1:1/none", connect_args={"connect_timeout": 2})
    reported: list[BaseException | None] = []
    waker = Waker(engine, report=reported.append)
    try:
        waker.open()
    finally:
        waker.close()
    assert len(reported) == 1 and isinstance(reported[0], sa.exc.OperationalError)
    assert is_unreachable(reported[0]) and not only_dropped(reported[0])
