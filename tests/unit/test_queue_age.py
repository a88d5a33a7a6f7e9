"""The oldest ready message's age, from the send stamps of each priority's next message."""

from __future__ import annotations

from celery_durable.headers import SENT_AT_HEADER
from celery_durable.planning.queue_age import oldest_age


def test_the_oldest_stamp_of_the_heads_gives_the_age():
    heads = [{SENT_AT_HEADER: 100.0}, {SENT_AT_HEADER: 95.5}, {"task": "x"}]
    assert oldest_age(heads, now=110.0) == 14.5


def test_no_stamp_means_no_age_not_zero():
    assert oldest_age([{"task": "x"}, {SENT_AT_HEADER: "not a time"}], now=1.0) is None
    assert oldest_age([], now=1.0) is None


def test_a_stamp_from_a_clock_ahead_reads_as_zero():
    assert oldest_age([{SENT_AT_HEADER: 50.0}], now=40.0) == 0.0


def test_an_empty_queue_is_0_seconds_old_and_a_full_one_as_old_as_its_oldest_head():
    from celery_durable.planning.queue_age import oldest_ready_seconds

    assert oldest_ready_seconds(0, [], now=5.0) == 0.0
    assert oldest_ready_seconds(2, [{SENT_AT_HEADER: 1.0}], now=5.0) == 4.0
    assert oldest_ready_seconds(2, [{}], now=5.0) is None
