"""The one Clock: the system's, and the fake a test moves by hand."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from celery_durable.clock import SYSTEM_CLOCK, Clock
from celery_durable.testing.clock import EPOCH, FakeClock


def test_the_system_clock_reads_aware_utc_and_a_monotonic_that_does_not_go_back():
    first, wall = SYSTEM_CLOCK.monotonic(), SYSTEM_CLOCK.now()
    assert wall.tzinfo is not None and wall.utcoffset() == timedelta(0)
    assert SYSTEM_CLOCK.monotonic() >= first


def test_a_fake_clock_stands_still_until_moved_and_moves_both_readings_together():
    clock: Clock = FakeClock()
    assert (clock.monotonic(), clock.now()) == (0.0, EPOCH)
    assert (clock.monotonic(), clock.now()) == (0.0, EPOCH)
    assert isinstance(clock, FakeClock)
    clock.advance(2.5)
    assert (clock.monotonic(), clock.now()) == (2.5, EPOCH + timedelta(seconds=2.5))
    clock.set(10.0)
    assert (clock.monotonic(), clock.now()) == (10.0, EPOCH + timedelta(seconds=10))


def test_a_fake_clock_counts_its_reads():
    clock = FakeClock(monotonic=5.0, now=datetime(2030, 1, 1, tzinfo=timezone.utc))
    clock.monotonic()
    clock.now()
    clock.advance(1.0)  # moving it is no read
    assert clock.reads == 2


def test_a_fake_clock_refuses_a_naive_wall_time():
    with pytest.raises(ValueError, match="aware"):
        FakeClock(now=datetime(2030, 1, 1))
