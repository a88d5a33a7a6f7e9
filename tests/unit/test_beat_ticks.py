"""The beat tick planner: occurrences from the schedule alone, on-time ticks, and each catch-up policy."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery.schedules import crontab, schedule

from celery_durable.planning.beat_ticks import (
    ALL,
    NONE,
    RUN_ONCE,
    SKIP,
    Fire,
    latest_occurrence,
    next_occurrence,
    plan_ticks,
)

T0 = datetime(2026, 12, 3, 12, 0, 0, tzinfo=timezone.utc)
EVERY_SECOND = schedule(timedelta(seconds=1))
#: What the scheduler hands the planner with EVERY_SECOND (beat.entries.fixed_interval).
ONE_SECOND = timedelta(seconds=1)


def s(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_occurrences_come_from_the_schedule_not_the_clock():
    assert next_occurrence(EVERY_SECOND, T0) == s(1)
    assert next_occurrence(crontab(minute="*/5"), s(61)) == s(300)
    assert next_occurrence(crontab(hour=2, minute=0), T0) == datetime(2026, 12, 4, 2, 0, tzinfo=timezone.utc)
    # Asked twice, a second apart by the clock, the same instant: the tick is a fire's identity.
    assert next_occurrence(crontab(minute="*"), s(0.5)) == next_occurrence(crontab(minute="*"), s(0.5))


def test_the_latest_occurrence_is_found_without_walking_a_long_outage():
    year_later = T0 + timedelta(days=365)
    assert latest_occurrence(EVERY_SECOND, T0, year_later, every=ONE_SECOND) == year_later
    assert latest_occurrence(crontab(minute=0), T0, year_later - timedelta(minutes=1), every=None) == \
        year_later - timedelta(hours=1)
    assert latest_occurrence(EVERY_SECOND, T0, s(0.5), every=ONE_SECOND) is None


def test_an_interval_keeps_the_grid_of_its_watermark_through_a_catch_up():
    """An interval's ticks are counted from its last one: the latest missed is on that grid, never at
    an instant the outage happened to end on."""
    watermark = s(0.3)
    assert latest_occurrence(EVERY_SECOND, watermark, s(29.9), every=ONE_SECOND) == s(29.3)
    plan = plan_ticks(EVERY_SECOND, watermark, s(30), catch_up=SKIP, grace=5.0, max_catch_up=100, every=ONE_SECOND)
    assert [f.tick for f in plan.fires] == [s(24.3)] + [s(25.3 + i) for i in range(5)]
    plan = plan_ticks(EVERY_SECOND, watermark, s(30), catch_up=NONE, grace=5.0, max_catch_up=100, every=ONE_SECOND)
    assert plan.missed_to == s(24.3) and plan.fires[0].tick == s(25.3)


def test_the_scheduler_hands_the_planner_an_intervals_fixed_step_and_none_for_a_calendar():
    from celery_durable.beat.entries import fixed_interval

    assert fixed_interval(EVERY_SECOND) == ONE_SECOND
    assert fixed_interval(schedule(timedelta(minutes=5))) == timedelta(minutes=5)
    assert fixed_interval(crontab(minute="*/5")) is None
    assert fixed_interval(schedule(timedelta(seconds=30), relative=True)) is None


def test_a_running_leader_sends_each_tick_once_and_its_watermark_rides_the_fire():
    plan = plan_ticks(EVERY_SECOND, T0, s(3.2), catch_up=NONE, grace=5.0, max_catch_up=100, every=ONE_SECOND)
    assert plan.fires == (Fire(s(1), s(1)), Fire(s(2), s(2)), Fire(s(3), s(3)))
    assert plan.watermark == s(3) and plan.next_due == s(4)
    again = plan_ticks(EVERY_SECOND, plan.watermark, s(3.9), catch_up=NONE, grace=5.0, max_catch_up=100,
                       every=ONE_SECOND)
    assert again.fires == () and again.watermark == s(3)


@pytest.mark.parametrize(("policy", "sent"), [
    (NONE, []),
    (SKIP, [Fire(s(25), s(25))]),
    (RUN_ONCE, [Fire(s(1), s(25), covers_from=s(1), covers_to=s(25))]),
    (ALL, [Fire(s(i), s(i)) for i in range(1, 26)]),
])
def test_each_catch_up_policy_after_a_30_second_outage(policy, sent):
    """Down from T0 to T0+30 s, grace 5 s: ticks 1..25 were missed (the policy decides), 26..30 are on time."""
    plan = plan_ticks(EVERY_SECOND, T0, s(30), catch_up=policy, grace=5.0, max_catch_up=100, every=ONE_SECOND)
    on_time = [Fire(s(i), s(i)) for i in range(26, 31)]
    assert list(plan.fires) == sent + on_time
    assert plan.watermark == s(30) and plan.cut == 0


def test_all_is_bounded_and_says_what_it_cut_and_its_last_send_carries_the_watermark_past_them():
    plan = plan_ticks(EVERY_SECOND, T0, s(30), catch_up=ALL, grace=5.0, max_catch_up=10, every=ONE_SECOND)
    assert [f.tick for f in plan.fires] == [s(i) for i in range(1, 11)] + [s(i) for i in range(26, 31)]
    assert plan.fires[9] == Fire(s(10), s(25)), "the tenth send moves the watermark past the 15 cut"
    assert (plan.cut, plan.cut_exact) == (15, True)


def test_bad_policies_and_bounds_are_refused():
    with pytest.raises(ValueError, match="catch_up must be one of"):
        plan_ticks(EVERY_SECOND, T0, s(3), catch_up="later", grace=5.0, max_catch_up=100, every=ONE_SECOND)
    with pytest.raises(ValueError, match="max_catch_up must be at least 1"):
        plan_ticks(EVERY_SECOND, T0, s(3), catch_up=ALL, grace=5.0, max_catch_up=0, every=ONE_SECOND)


def test_entries_are_read_and_each_bad_one_is_named():
    from celery import Celery

    from celery_durable.beat.entries import read_entries
    from celery_durable.errors import BeatEntryInvalid

    app = Celery("entries-test", set_as_current=False)

    @app.task(name="t.ping")
    def ping() -> None: ...

    read = read_entries(app, {"line": {"task": "t.ping", "schedule": "*/5 * * * *"},
                              "secs": {"task": "t.ping", "schedule": 2, "options": {"durable_catch_up": "all",
                                                                                     "queue": "q"}}})
    assert next_occurrence(read["line"].schedule, T0) == s(300)
    assert (read["secs"].catch_up, read["secs"].options) == (ALL, {"queue": "q"})
    for spec, named in [({"task": "t.ping", "schedule": "61 * * * *"}, "is not a crontab line"),
                        ({"task": "t.ping", "schedule": 0}, "must be more than 0"),
                        ({"task": "t.ping", "schedule": 1, "args": "x"}, "args must be a list or tuple"),
                        ({"schedule": 1}, "task must be a task name")]:
        with pytest.raises(BeatEntryInvalid, match=f"beat_schedule entry 'bad': .*{named}"):
            read_entries(app, {"bad": spec})
