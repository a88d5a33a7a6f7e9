"""The operator commands' numeric options: NaN, infinity and numbers past what a timer or a query takes are refused."""

from __future__ import annotations

import click
import pytest

from celery_durable.cli.options import Seconds, count
from celery_durable.config import LARGEST_LIMIT, DurableConfig
from celery_durable.errors import ConfigInvalid
from celery_durable.planning.durations import LONGEST_SECONDS, DurationInvalid, parse_duration


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "1e400", "0.1", "3601", "-1"])
def test_seconds_refuses_nan_infinity_and_values_outside_its_range(text):
    with pytest.raises(click.BadParameter):
        Seconds(0.2, 3600).convert(text, None, None)


@pytest.mark.parametrize(("text", "seconds"), [("0.2", 0.2), ("2", 2.0), ("3600", 3600.0)])
def test_seconds_takes_a_finite_number_in_its_range(text, seconds):
    assert Seconds(0.2, 3600).convert(text, None, None) == seconds


@pytest.mark.parametrize("text", ["0", "-1", "99999999999999999999", str(LARGEST_LIMIT + 1)])
def test_a_count_past_what_a_store_takes_as_a_limit_is_refused(text):
    with pytest.raises(click.BadParameter):
        count().convert(text, None, None)


def test_the_largest_count_is_taken():
    assert count().convert(str(LARGEST_LIMIT), None, None) == LARGEST_LIMIT


@pytest.mark.parametrize("text", ["99999999999999999999d", "36501d", "5215w", "9" * 400 + "d"])
def test_a_duration_longer_than_a_datetime_can_go_back_is_refused_by_name(text):
    with pytest.raises(DurationInvalid) as caught:
        parse_duration(text)
    assert str(caught.value) == f"{text!r} is longer than the longest duration taken, 36500d"


def test_the_longest_duration_is_taken():
    assert parse_duration("36500d") == LONGEST_SECONDS


@pytest.mark.parametrize(("given", "named"), [
    ({"relay_batch_size": 10**20}, "durable_relay_batch_size must be a whole number <= 9223372036854775807"),
    ({"relay_poll_interval": 1e300}, "durable_relay_poll_interval must be <= 3600 seconds"),
])
def test_relay_settings_past_a_limit_or_a_timer_are_refused(given, named):
    with pytest.raises(ConfigInvalid) as caught:
        DurableConfig(**given)
    assert str(caught.value).startswith(named)
