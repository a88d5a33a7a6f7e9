"""Beat entries added or edited at run time: each field checked and named, and the leader's merge with code."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from celery import Celery
from celery.schedules import crontab, schedule

from celery_durable.beat.entries import read_entry
from celery_durable.beat.stored import MergedSchedule, as_beat_entry, readable
from celery_durable.beat.stored_spec import checked_edit, checked_new
from celery_durable.errors import BeatEntryInvalid
from celery_durable.store.beat_schedule import StoredEntry


def test_a_new_entry_takes_json_text_or_python_values_alike():
    from_cli = checked_new("n", task="t.x", every="2.5", args='[1, "a"]', kwargs='{"k": 1}', queue="q",
                           options='{"expires": 30, "durable_catch_up": "all"}')
    from_python = checked_new("n", task="t.x", every=2.5, args=[1, "a"], kwargs={"k": 1}, queue="q",
                              options={"expires": 30, "durable_catch_up": "all"})
    assert from_cli == from_python == StoredEntry("n", "t.x", 2.5, None, (1, "a"), {"k": 1},
                                                  {"expires": 30, "durable_catch_up": "all", "queue": "q"})
    cron = checked_new("c", task="t.x", crontab="  */5   *  * * * ")
    assert (cron.every, cron.crontab, cron.args, cron.kwargs, cron.options) == (None, "*/5 * * * *", (), {}, {})


@pytest.mark.parametrize(("fields", "named"), [
    ({"task": "t.x"}, "give exactly one schedule: every (seconds) or crontab"),
    ({"task": "t.x", "every": 1, "crontab": "* * * * *"}, "give exactly one schedule"),
    ({"task": "", "every": 1}, "task must be a task name"),
    ({"task": "t x", "every": 1}, "task must be a task name"),
    ({"task": None, "every": 1}, "task must be a task name"),
    ({"task": "t.x", "every": 0}, "every must be more than 0 seconds, got 0"),
    ({"task": "t.x", "every": "-3"}, "every must be more than 0 seconds, got -3.0"),
    ({"task": "t.x", "every": "nan"}, "every must be more than 0 seconds"),
    ({"task": "t.x", "every": "soon"}, "every must be a number of seconds, got 'soon'"),
    ({"task": "t.x", "every": True}, "every must be a number of seconds, got True"),
    ({"task": "t.x", "crontab": "99 * * * *"}, "crontab '99 * * * *' is not a crontab line"),
    ({"task": "t.x", "crontab": "* * *"}, "crontab '* * *' is not a crontab line"),
    ({"task": "t.x", "crontab": "0 0 31 2 *"}, "crontab '0 0 31 2 *' is not a crontab line"),
    ({"task": "t.x", "crontab": 5}, "crontab must be a crontab line"),
    ({"task": "t.x", "every": 1, "args": "[1,"}, "args is not JSON"),
    ({"task": "t.x", "every": 1, "args": '{"a": 1}'}, "args must be a JSON list"),
    ({"task": "t.x", "every": 1, "args": [object()]}, "args must be JSON values"),
    ({"task": "t.x", "every": 1, "kwargs": "[1]"}, "kwargs must be a JSON object"),
    ({"task": "t.x", "every": 1, "kwargs": {1: "a"}}, "kwargs must be a JSON object (string keys)"),
    ({"task": "t.x", "every": 1, "options": "nope"}, "options is not JSON"),
    ({"task": "t.x", "every": 1, "options": '{"durable_catch_up": "most"}'}, "options durable_catch_up must be one"),
    ({"task": "t.x", "every": 1, "queue": "a b"}, "queue must be a queue name"),
    ({"task": "t.x", "every": 1, "queue": ""}, "queue must be a queue name"),
])
def test_a_bad_field_is_refused_naming_the_entry_and_the_field(fields, named):
    with pytest.raises(BeatEntryInvalid) as refused:
        checked_new("e1", **fields)
    assert str(refused.value).startswith("schedule entry 'e1': "), refused.value
    assert named in str(refused.value), refused.value


@pytest.mark.parametrize("name", ["", "   ", "x" * 201, None, 7])
def test_a_bad_name_is_refused(name):
    with pytest.raises(BeatEntryInvalid, match="name must be a string of 1 to 200 characters"):
        checked_new(name, task="t.x", every=1)


def test_an_edit_replaces_the_fields_given_and_keeps_the_others():
    current = checked_new("e", task="t.x", every=5, args=[1], kwargs={"k": 1}, queue="q", options={"expires": 9})
    assert checked_edit(current, crontab="0 * * * *") == StoredEntry(
        "e", "t.x", None, "0 * * * *", (1,), {"k": 1}, {"expires": 9, "queue": "q"})
    back = checked_edit(checked_edit(current, crontab="0 * * * *"), every="7")
    assert (back.every, back.crontab) == (7.0, None), "every replaces a crontab"
    assert checked_edit(current, options="{}").options == {}, "options are replaced whole"
    assert checked_edit(current, options="{}", queue="r").options == {"queue": "r"}, "then queue sets theirs"
    assert checked_edit(current, task="t.y", args="[]").task == "t.y"
    assert checked_edit(current, task="t.y", args="[]").args == ()


def test_an_edit_of_nothing_or_of_both_schedules_or_of_a_bad_field_is_refused():
    current = checked_new("e", task="t.x", every=5)
    with pytest.raises(BeatEntryInvalid, match="nothing to change: give at least one of task, every, crontab"):
        checked_edit(current)
    with pytest.raises(BeatEntryInvalid, match="give one schedule, every or crontab, not both"):
        checked_edit(current, every=1, crontab="* * * * *")
    with pytest.raises(BeatEntryInvalid, match="schedule entry 'e': every must be more than 0"):
        checked_edit(current, every=-1)


APP = Celery("stored-test", set_as_current=False)


@APP.task(name="known.task")
def known() -> None:
    pass


def _app() -> Celery:
    return APP


def test_a_stored_entry_runs_as_its_beat_schedule_twin_would_and_may_name_a_task_the_app_lacks():
    app = _app()
    entry = as_beat_entry(app, checked_new("e", task="only.workers.know", every=3, args=[1],
                                           options={"durable_catch_up": "all", "queue": "q"}))
    assert isinstance(entry.schedule, schedule) and entry.schedule.run_every == timedelta(seconds=3)
    assert (entry.task, entry.args, entry.options, entry.catch_up) == ("only.workers.know", (1,), {"queue": "q"}, "all")
    cron = as_beat_entry(app, checked_new("c", task="known.task", crontab="*/5 * * * *"))
    assert isinstance(cron.schedule, crontab) and cron.schedule.minute == set(range(0, 60, 5))
    with pytest.raises(BeatEntryInvalid, match="is not registered"):
        read_entry(app, "e", {"task": "only.workers.know", "schedule": 3.0}), "beat_schedule still checks it"


def test_the_leader_merges_stored_entries_under_the_codes_and_says_what_changed(caplog):
    app = _app()
    code = {"nightly": read_entry(app, "nightly", {"task": "known.task", "schedule": 60.0})}
    merged = MergedSchedule(app, "b", code)
    caplog.set_level(logging.INFO, logger="celery_durable.beat")
    added = {"ping": checked_new("ping", task="known.task", every=1),
             "nightly": checked_new("nightly", task="known.task", every=2)}
    assert merged.merge({}) == code, "the leader's first round: nothing stored yet"
    first = merged.merge(added)
    assert sorted(first) == ["nightly", "ping"]
    assert first["nightly"] is code["nightly"], "the code's entry wins a shared name"
    again = merged.merge(added)
    assert again["ping"] is first["ping"], "an unchanged row is not read again"
    edited = merged.merge({**added, "ping": checked_new("ping", task="known.task", every=4)})
    assert edited["ping"].schedule.run_every == timedelta(seconds=4)
    assert sorted(merged.merge({"nightly": added["nightly"]})) == ["nightly"], "a removed row is not run"
    events = [r.event for r in caplog.records]  # type: ignore[attr-defined]
    assert events == ["durable.beat.stored_entry_added", "durable.beat.stored_entry_shadowed",
                      "durable.beat.stored_entry_edited", "durable.beat.stored_entry_removed"], events


def test_a_new_leader_says_the_entries_it_finds_were_loaded_not_added(caplog):
    app = _app()
    caplog.set_level(logging.INFO, logger="celery_durable.beat")
    before = {"ping": checked_new("ping", task="known.task", every=1)}
    merged = MergedSchedule(app, "b", {})
    merged.merge(before)
    merged.merge({**before, "pong": checked_new("pong", task="known.task", every=2)})
    said = [(r.event, r.entry) for r in caplog.records]  # type: ignore[attr-defined]
    assert said == [("durable.beat.stored_entry_loaded", "ping"), ("durable.beat.stored_entry_added", "pong")], said


def test_a_stored_row_that_no_longer_reads_is_skipped_and_said_not_run(caplog):
    merged = MergedSchedule(_app(), "b", {})
    unreadable = StoredEntry("bad", "known.task", None, "0 0 31 2 *")  # written by hand, past the checks
    assert merged.merge({"bad": unreadable}) == {}
    assert [r.event for r in caplog.records] == ["durable.beat.stored_entry_unreadable"]  # type: ignore[attr-defined]


def test_readable_leaves_out_the_codes_names_and_sets_apart_a_row_that_does_not_read():
    rows = {"ping": StoredEntry("ping", "known.task", 30.0), "hourly": StoredEntry("hourly", "known.task", 5.0),
            "bad": StoredEntry("bad", "known.task", None, "0 0 31 2 *")}
    entries, unreadable = readable(_app(), rows, {"hourly"})
    assert list(entries) == ["ping"] and entries["ping"].task == "known.task"
    assert list(unreadable) == ["bad"] and "bad" in str(unreadable["bad"])
