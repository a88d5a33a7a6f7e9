"""The dashboard's panels from tables of stored state: what each shows, and which rows are problems and why."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from celery_durable.beat.holder import new_holder
from celery_durable.cli.dashboard_panels import (
    STUCK_AFTER,
    ConfiguredEntry,
    beat_panel,
    leader_view,
    limits_panel,
    outbox_panel,
    problems,
    sleeping_panel,
)
from celery_durable.store.beat import EntryState, Leadership
from celery_durable.store.runs import Run

NOW = datetime(2026, 5, 1, 12, 0, 0, tzinfo=timezone.utc)
GRACE = 10.5


def at(seconds: float) -> datetime:
    return NOW + timedelta(seconds=seconds)


def entry(name: str, due_in: float) -> ConfiguredEntry:
    return ConfiguredEntry(name, "reports.send", "<freq: 1.00 minute>", at(due_in))


# -- beat --------------------------------------------------------------------------------------
def test_the_leader_is_shown_as_the_host_and_pid_its_token_names():
    lead = Leadership(new_holder("beat-1.example", 4242), 3, at(8))
    assert leader_view(lead, NOW) == {"holder": lead.holder, "host": "beat-1.example", "pid": 4242, "term": 3,
                                      "expires_in_seconds": 8.0}


def test_an_older_replicas_token_is_shown_as_it_is_without_a_host():
    lead = Leadership("0123456789abcdef0123456789abcdef", 1, at(5))
    view = leader_view(lead, NOW)
    assert view is not None and view["holder"] == lead.holder and view["host"] is None and view["pid"] is None


def test_an_expired_lease_is_no_leader():
    assert leader_view(Leadership(new_holder("h", 1), 1, at(-0.001)), NOW) is None


def test_entries_show_their_last_send_its_lag_and_when_they_are_next_due():
    states = {"hourly": EntryState(watermark=at(-30), paused=False, last_fire_at=at(-29.2), last_tick=at(-30)),
              "nightly": EntryState(watermark=at(-100), paused=True, last_fire_at=None, last_tick=None)}
    panel = beat_panel("prod", Leadership(new_holder("b", 9), 2, at(5)), [entry("hourly", 30), entry("nightly", -500)],
                       states, NOW, GRACE)
    hourly, nightly = panel["entries"]
    assert hourly == {"name": "hourly", "source": "code", "task": "reports.send", "schedule": "<freq: 1.00 minute>",
                      "paused": False,
                      "next_due": at(30).isoformat(), "last_tick": at(-30).isoformat(),
                      "last_fire_at": at(-29.2).isoformat(), "lag_seconds": 0.8, "problem": None}
    # Paused: not due, and not late however far its watermark is behind.
    assert nightly["paused"] is True and nightly["next_due"] is None and nightly["problem"] is None
    assert panel["last_fire"] == {"entry": "hourly", "at": at(-29.2).isoformat(), "tick": at(-30).isoformat(),
                                  "lag_seconds": 0.8, "ago_seconds": 29.2}
    assert panel["problem"] is None and panel["leader"]["host"] == "b"


def test_an_entry_late_past_the_grace_is_a_problem_naming_the_leader_that_did_not_send_it():
    panel = beat_panel("prod", Leadership(new_holder("beat-2", 77), 1, at(5)),
                       [entry("on_time", -GRACE), entry("late", -GRACE - 1)], {}, NOW, GRACE)
    on_time, late = panel["entries"]
    assert on_time["problem"] is None
    assert late["problem"] == "overdue by 12 s: the leader (beat-2 pid 77) has not sent it"


def test_without_a_leader_the_beat_and_its_late_entries_are_problems():
    panel = beat_panel("prod", Leadership(new_holder("gone", 1), 4, at(-1)), [entry("late", -60)], {}, NOW, GRACE)
    assert panel["leader"] is None
    assert panel["problem"].startswith("no replica leads beat 'prod': no entry is sent")
    assert panel["entries"][0]["problem"] == "overdue by 60 s: no beat replica leads, so nothing is sent"


def test_no_leader_is_no_problem_when_there_is_nothing_to_send():
    assert beat_panel("prod", None, [], {}, NOW, GRACE)["problem"] is None
    paused = {"n": EntryState(at(-5), True, None, None)}
    assert beat_panel("prod", None, [entry("n", 5)], paused, NOW, GRACE)["problem"] is None


# -- limits ------------------------------------------------------------------------------------
def test_each_scope_shows_held_waiting_and_its_limit_and_a_full_scope_with_waiters_is_no_problem():
    rows = limits_panel([("sync", "key", "org:1", 1), ("export", "task", "", 2)],
                        [("sync", "key", "org:1", 3, 0, at(-600), None)],
                        {("sync", "key"): 1, ("export", "task"): 3}, NOW)
    assert rows == [
        {"task": "export", "kind": "task", "key": "", "held": 2, "waiting": 0, "ready": 0, "limit": 3,
         "oldest_waiting_seconds": None, "full": False, "problem": None},
        {"task": "sync", "kind": "key", "key": "org:1", "held": 1, "waiting": 3, "ready": 0, "limit": 1,
         "oldest_waiting_seconds": 600.0, "full": True, "problem": None},
    ]


def test_waiters_beside_a_free_turn_for_long_are_a_problem_and_not_before():
    fresh = limits_panel([], [("sync", "key", "org:1", 2, 0, at(-STUCK_AFTER), None)], {("sync", "key"): 1}, NOW)
    assert fresh[0]["problem"] is None
    stuck = limits_panel([], [("sync", "key", "org:1", 2, 0, at(-STUCK_AFTER - 1), None)], {("sync", "key"): 1}, NOW)
    assert stuck[0]["problem"] == ("2 waiting for 31 s with 1 turn(s) free: no live worker has swept this scope "
                                   "(is a -P durable worker running against this store?)")


def test_waiters_that_no_live_worker_declares_a_limit_for_are_a_problem():
    rows = limits_panel([], [("sync", "key", "org:1", 1, 0, at(-90), None)], {}, NOW)
    assert rows[0]["limit"] is None and rows[0]["problem"] == (
        "1 waiting for 90 s, and no live worker declares this limit: they wait for a -P durable worker running "
        "sync to start")


def test_messages_given_their_turn_and_never_sent_on_are_a_problem():
    rows = limits_panel([("sync", "key", "org:1", 1)], [("sync", "key", "org:1", 0, 1, at(-200), at(-45))],
                        {("sync", "key"): 1}, NOW)
    assert rows[0]["ready"] == 1 and rows[0]["problem"].startswith("1 message(s) given their turn 45 s ago and not "
                                                                   "sent on: no -P durable worker's limit dispatcher")


# -- sleeping runs -----------------------------------------------------------------------------
def run(run_id: str, wake_in: float | None, queue: str | None = "q") -> Run:
    return Run(run_id, "etl.load", queue, "sleeping", 1, "[]", "{}", None, None, at(-3600), at(-60), None,
               wake_at=None if wake_in is None else at(wake_in))


def test_sleeping_runs_show_when_they_wake_and_one_long_overdue_is_a_problem_naming_its_queue():
    rows = sleeping_panel([run("soon", 120), run("due", -30), run("stuck", -30 - STUCK_AFTER - 1), run("x", None)],
                          NOW, lease_ttl=30)
    assert [(r["id"], r["wakes_in_seconds"], r["problem"]) for r in rows] == [
        ("soon", 120.0, None), ("due", -30.0, None),
        ("stuck", -61.0, "its wake-up was due 61 s ago and it has not resumed: is a -P durable worker consuming "
                         "queue 'q'?"),
        ("x", None, None)]
    assert rows[0]["wake_at"] == at(120).isoformat() and rows[0]["asleep_since"] == at(-60).isoformat()


# -- outbox ------------------------------------------------------------------------------------
def test_a_row_whose_publish_failed_shows_the_error_it_keeps_as_its_problem():
    failing = [{"task_id": "t1", "task_name": "mail.send", "attempts": 12, "created_at": at(-300),
                "available_at": at(20), "last_error": "OperationalError: [Errno 111] Connection refused\ntrace"},
               {"task_id": "t2", "task_name": "mail.send", "attempts": 1, "created_at": at(-5),
                "available_at": at(1), "last_error": None}]
    panel = outbox_panel(7, at(-300), failing, NOW, flag_after=10)
    assert panel["backlog"] == 7 and panel["oldest_seconds"] == 300.0
    first, second = panel["failing"]
    assert first == {"task_id": "t1", "task": "mail.send", "attempts": 12,
                     "error": "OperationalError: [Errno 111] Connection refused\ntrace", "flagged": True,
                     "age_seconds": 300.0, "next_try_in_seconds": 20.0,
                     "problem": "publish failed 12 time(s): OperationalError: [Errno 111] Connection refused"}
    assert second["flagged"] is False and second["problem"] == "publish failed 1 time(s): no error was recorded"
    assert panel["problem"] == "2 outbox row(s) failed to publish and wait to be tried again"


def test_a_backlog_that_publishes_is_no_problem():
    assert outbox_panel(3, at(-1), [], NOW, flag_after=10)["problem"] is None
    assert outbox_panel(0, None, [], NOW, flag_after=10)["oldest_seconds"] is None


def test_the_summary_lists_every_panels_problems_one_line_each():
    found = {
        "beat": beat_panel("prod", None, [entry("late", -60)], {}, NOW, GRACE),
        "limits": limits_panel([], [("sync", "key", "org:1", 1, 0, at(-90), None)], {}, NOW),
        "sleeping": sleeping_panel([run("stuck", -600)], NOW, lease_ttl=30),
        "outbox": outbox_panel(1, at(-9), [{"task_id": "t1", "task_name": "m", "attempts": 1, "created_at": at(-9),
                                            "available_at": at(1), "last_error": "boom"}], NOW, flag_after=10),
    }
    lines = problems(found)
    assert [line.split(":")[0] for line in lines] == ["beat", "beat entry late", "limit sync key org",
                                                      "sleeping run stuck", "outbox t1 (m)"]
    assert problems({"beat": None, "limits": [], "sleeping": [], "outbox": outbox_panel(0, None, [], NOW, 10)}) == []
