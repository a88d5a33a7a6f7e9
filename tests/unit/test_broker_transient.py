"""broker.transient.TransientSender: transient messages inserted from a thread, in order and in batches."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import pytest

from celery_durable.broker.rows import Outgoing
from celery_durable.broker.transient import TransientSender


def _messages(count: int) -> list[Outgoing]:
    return [Outgoing("celeryev.m", {"n": n}) for n in range(count)]


def test_queued_messages_are_inserted_in_order_in_batches_and_flush_sends_them_all() -> None:
    release = threading.Event()
    batches: list[list[int]] = []

    def insert(messages: Sequence[Outgoing]) -> None:
        release.wait(5)  # the first batch waits while the rest queue up behind it
        batches.append([m.payload["n"] for m in messages])

    sender = TransientSender(insert, batch=4)
    sender.send(_messages(1))
    sender.send(_messages(10)[1:])
    release.set()
    sender.flush()
    assert [n for batch in batches for n in batch] == list(range(10))
    assert all(len(batch) <= 4 for batch in batches) and len(batches) < 10
    assert (sender.sent, sender.lost) == (10, 0)


def test_a_refused_batch_is_counted_and_logged_and_the_next_one_goes(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def insert(messages: Sequence[Outgoing]) -> None:
        calls.append(len(messages))
        if len(calls) == 1:
            raise RuntimeError("the database went away")

    sender = TransientSender(insert)
    with caplog.at_level(logging.WARNING, logger="celery_durable.broker.transient"):
        sender.send(_messages(2))
        sender.flush()
        sender.send(_messages(3))
        sender.flush()
    assert (sender.sent, sender.lost) == (3, 2)
    assert "durable.broker.transient_lost count=2 error=the database went away" in caplog.text
