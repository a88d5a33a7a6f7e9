"""The dashboard's store reads on PostgreSQL and SQLite: the state workers, beat and the relay write, read back
into the panels (the panels' judgement is unit-tested from tables in tests/unit/test_dashboard_panels.py)."""

from __future__ import annotations

import json
from datetime import timedelta

from celery import Celery

from celery_durable.beat.holder import new_holder
from celery_durable.cli.dashboard_reads import read_panels
from celery_durable.config import from_celery_conf
from celery_durable.planning.limit_declarations import Scope
from celery_durable.planning.limits import WAIT, LimitAsk
from celery_durable.store import beat as store_beat
from celery_durable.store import limit_declarations, limit_waiting
from celery_durable.store import limits as store_limits
from celery_durable.store import outbox as store_outbox
from celery_durable.store import runs as store_runs
from celery_durable.store.clock import store_now
from celery_durable.store.engine import engine_for, ensure_schema


def _app() -> Celery:
    app = Celery("shop", broker="memory://")

    @app.task(name="reports.send", shared=False)
    def send() -> None:  # a task the schedule names: beat refuses one that is not registered
        pass

    app.conf.beat_schedule = {"hourly": {"task": "reports.send", "schedule": 3600.0}}
    return app


def _message(task_id: str) -> limit_waiting.WaitingMessage:
    return limit_waiting.WaitingMessage(task_id=task_id, queue="q", exchange="", routing_key="q", body=b"[[], {}, {}]",
                                        headers=json.dumps({"id": task_id}), properties="{}",
                                        content_type="application/json", content_encoding="utf-8")


def test_the_panels_read_a_leader_an_entry_a_held_limit_with_a_waiter_a_sleeping_run_and_a_failed_publish(store_url):
    app = _app()
    holder = new_holder("beat-host", 4321)
    scope = Scope("sync", "key", "org:1", 1)
    with ensure_schema(store_url).begin() as conn:
        now = store_now(conn)
        store_beat.lead(conn, "shop", holder, 10.0, now)
        store_beat.add_entry(conn, "shop", "hourly", now - timedelta(seconds=60))
        tick = now - timedelta(seconds=1)
        store_beat.fire(conn, "shop", "hourly", tick, tick, "t-fire", 1, now)
        limit_declarations.declare(conn, "worker-1", {("sync", "key"): 1}, 30.0, now)
        asks = [LimitAsk("sync", f"r{i}", (scope,), None, WAIT) for i in range(2)]
        store_limits.take_batch(conn, asks, [_message(a.task_id) for a in asks], holder="worker-1", ttl=30.0, now=now)
        store_runs.begin_attempt(conn, run_id="nap", task_name="etl.load", queue="q", args="[]", kwargs="{}",
                                 token="tok", lease_seconds=30.0)
        store_runs.hand_off_to_sleep(conn, "nap", "tok", wake_at=now + timedelta(hours=1))
        store_outbox.insert_txn(conn, task_id="poison", task_name="mail.send", args="[]", kwargs="{}", options="{}",
                                at=now)
        (row,) = store_outbox.claim(conn, 10, now)
        store_outbox.mark_failed(conn, row.id, attempts=3, error="KeyError: 'x'", retry_at=now + timedelta(seconds=8))
    with engine_for(store_url).connect() as conn:
        found = read_panels(conn, app, from_celery_conf(app.conf))
    beat = found["beat"]
    assert (beat["leader"]["host"], beat["leader"]["pid"], beat["leader"]["holder"]) == ("beat-host", 4321, holder)
    (hourly,) = beat["entries"]
    assert hourly["task"] == "reports.send" and hourly["last_fire_at"] is not None and hourly["problem"] is None
    assert abs(hourly["lag_seconds"] - 1.0) < 0.01 and beat["last_fire"]["entry"] == "hourly"
    (held,) = found["limits"]
    assert (held["task"], held["key"], held["held"], held["waiting"], held["ready"], held["limit"], held["full"]) == \
        ("sync", "org:1", 1, 1, 0, 1, True)
    (nap,) = found["sleeping"]
    assert nap["id"] == "nap" and 3590 < nap["wakes_in_seconds"] <= 3600
    (stuck,) = found["outbox"]["failing"]
    assert (stuck["task_id"], stuck["attempts"], stuck["error"]) == ("poison", 3, "KeyError: 'x'")
    assert found["outbox"]["backlog"] == 1 and 0 < stuck["next_try_in_seconds"] <= 8
    assert found["problems"] == ["outbox poison (mail.send): publish failed 3 time(s): KeyError: 'x'"]
    assert found["dead_runs"] == []


def test_an_empty_store_of_an_app_without_a_schedule_has_empty_panels_and_no_problem(store_url):
    app = _app()
    app.conf.beat_schedule = {}
    with ensure_schema(store_url).connect() as conn:
        found = read_panels(conn, app, from_celery_conf(app.conf))
    assert (found["beat"]["leader"], found["beat"]["entries"], found["beat"]["problem"]) == (None, [], None)
    assert (found["limits"], found["sleeping"], found["outbox"]["failing"], found["problems"]) == ([], [], [], [])


def test_a_schedule_no_replica_leads_is_the_one_problem(store_url):
    app = _app()
    with ensure_schema(store_url).connect() as conn:
        found = read_panels(conn, app, from_celery_conf(app.conf))
    assert found["beat"]["leader"] is None and found["beat"]["entries"][0]["last_fire_at"] is None
    assert found["problems"] == ["beat: no replica leads beat 'shop': no entry is sent (is `celery beat -S "
                                 "celery_durable.Scheduler` running against this store?)"]


def test_a_schedule_the_dashboard_cannot_read_is_a_problem_and_the_other_panels_are_still_read(store_url):
    app = _app()
    app.conf.beat_schedule = {"bad": {"task": "not.registered", "schedule": 5}}
    with ensure_schema(store_url).connect() as conn:
        found = read_panels(conn, app, from_celery_conf(app.conf))
    assert found["beat"] is None and found["outbox"]["backlog"] == 0
    assert found["problems"] == ["the beat could not be read: beat_schedule entry 'bad': task 'not.registered' is "
                                 "not registered in this app (is the module defining it imported?)"]


def test_the_beat_panel_lists_entries_stored_at_run_time_beside_the_apps_and_a_stored_name_of_both_once(store_url):
    from celery_durable.beat import schedule_entries

    app = _app()
    app.conf.durable_database_url = store_url
    ensure_schema(store_url)
    schedule_entries.add(app, "ping", task="ops.ping", every=30)
    with engine_for(store_url).connect() as conn:
        found = read_panels(conn, app, from_celery_conf(app.conf))
    entries = {e["name"]: (e["source"], e["task"]) for e in found["beat"]["entries"]}
    assert entries == {"hourly": ("code", "reports.send"), "ping": ("stored", "ops.ping")}
