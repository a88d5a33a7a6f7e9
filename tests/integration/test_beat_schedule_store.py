"""Beat entries stored at run time on PostgreSQL and SQLite: add, edit, remove through the one write path,
the app's beat_schedule read-only, racing adds of one name, and migration 0013 both ways."""

from __future__ import annotations

from datetime import timedelta

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_durable.beat import schedule_entries
from celery_durable.beat.stored import MergedSchedule
from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.errors import BeatEntryInvalid, ScheduleEditRefused
from celery_durable.store import beat as beat_store
from celery_durable.store import beat_schedule as store
from celery_durable.store.beat_schedule import StoredEntry
from celery_durable.store.engine import engine_for, ensure_schema
from tests.threads import run_together

BEAT = "sched"


def _app(url: str) -> Celery:
    app = Celery(BEAT, set_as_current=False)
    app.conf.durable_database_url = url
    app.conf.beat_schedule = {"from-code": {"task": "t.code", "schedule": 5.0}}
    return app


def _stored(url: str) -> dict[str, StoredEntry]:
    with engine_for(url).connect() as conn:
        return store.stored_entries(conn, BEAT)


def test_an_entry_is_added_edited_and_removed_and_reads_back_as_written(store_url):
    app = _app(store_url)
    added = schedule_entries.add(app, "ping", task="ops.ping", every=30, args="[1]", kwargs='{"db": "main"}',
                                 queue="ops", options='{"expires": 20, "durable_catch_up": "run_once"}')
    assert _stored(store_url) == {"ping": added}
    assert added == StoredEntry("ping", "ops.ping", 30.0, None, (1,), {"db": "main"},
                                {"expires": 20, "durable_catch_up": "run_once", "queue": "ops"})
    edited = schedule_entries.edit(app, "ping", crontab="*/5 * * * *", kwargs={"db": "replica"})
    assert _stored(store_url) == {"ping": edited}
    assert (edited.every, edited.crontab, edited.args, edited.kwargs, edited.options["queue"]) == \
        (None, "*/5 * * * *", (1,), {"db": "replica"}, "ops"), "the fields not given are kept"
    schedule_entries.remove(app, "ping")
    assert _stored(store_url) == {}


def test_the_apps_beat_schedule_is_read_only_and_unknown_or_taken_names_are_refused(store_url):
    app = _app(store_url)
    with pytest.raises(ScheduleEditRefused, match=r"schedule entry 'from-code': an entry of that name is in the "
                                                  r"app's beat_schedule, read-only here \(change it in code\); add"):
        schedule_entries.add(app, "from-code", task="t.x", every=1)
    for action in (lambda: schedule_entries.edit(app, "from-code", every=2),
                   lambda: schedule_entries.remove(app, "from-code")):
        with pytest.raises(ScheduleEditRefused, match="schedule entry 'from-code': it is in the app's beat_schedule"):
            action()
    schedule_entries.add(app, "mine", task="t.x", every=1)
    with pytest.raises(ScheduleEditRefused, match="schedule entry 'mine' is stored already: edit it, or remove it"):
        schedule_entries.add(app, "mine", task="t.y", crontab="* * * * *")
    with pytest.raises(ScheduleEditRefused, match=r"no stored schedule entry named 'nope' \(stored: mine\); edit"):
        schedule_entries.edit(app, "nope", every=3)
    with pytest.raises(ScheduleEditRefused, match=r"no stored schedule entry named 'nope' \(stored: mine\); remove"):
        schedule_entries.remove(app, "nope")
    with pytest.raises(BeatEntryInvalid, match="schedule entry 'mine': crontab '61 \\* \\* \\* \\*' is not a crontab"):
        schedule_entries.edit(app, "mine", crontab="61 * * * *")
    assert _stored(store_url)["mine"].task == "t.x", "a refused change writes nothing"


def test_a_removed_entry_forgets_its_watermark_and_pause_so_a_new_one_of_its_name_starts_afresh(store_url):
    app = _app(store_url)
    schedule_entries.add(app, "gone", task="t.x", every=1)
    t0 = SYSTEM_CLOCK.now() - timedelta(hours=1)
    with engine_for(store_url).begin() as conn:
        beat_store.add_entry(conn, BEAT, "gone", t0)
        beat_store.set_paused(conn, BEAT, "gone", True, t0)
        assert beat_store.fire(conn, BEAT, "gone", t0, t0, "id-1", 1, t0)
    schedule_entries.remove(app, "gone")
    with engine_for(store_url).connect() as conn:
        assert "gone" not in beat_store.entry_states(conn, BEAT)
        assert [task_id for _, _, task_id, _ in beat_store.fired(conn, BEAT, "gone")] == ["id-1"], "the audit stays"
    with engine_for(store_url).begin() as conn:
        beat_store.add_entry(conn, BEAT, "gone", t0)  # a leader's round in flight tracks it again
    schedule_entries.add(app, "gone", task="t.y", every=1)
    with engine_for(store_url).connect() as conn:
        assert "gone" not in beat_store.entry_states(conn, BEAT), "a new entry of the name starts afresh"


def test_racing_adds_of_one_name_store_one_and_refuse_the_rest(store_url):
    ensure_schema(store_url)
    app = _app(store_url)
    won: list[int] = []
    refused: list[int] = []

    def add(n: int) -> None:
        try:
            schedule_entries.add(app, "race", task=f"t.n{n}", every=n + 1)
            won.append(n)
        except ScheduleEditRefused:
            refused.append(n)

    run_together(add, 6)
    assert len(won) == 1 and len(refused) == 5, (won, refused)
    assert _stored(store_url)["race"].task == f"t.n{won[0]}"


def test_the_leaders_merge_reads_what_was_written(store_url):
    app = _app(store_url)
    schedule_entries.add(app, "a", task="t.a", every=2)
    merged = MergedSchedule(app, BEAT, {})
    with engine_for(store_url).connect() as conn:
        entries = merged.entries(conn)
    assert list(entries) == ["a"] and entries["a"].schedule.run_every == timedelta(seconds=2)


def test_migration_0013_adds_and_drops_its_table(store_url):
    from alembic import command

    from celery_durable.store.engine import alembic_config, current_revision

    ensure_schema(store_url)
    with engine_for(store_url).begin() as conn:
        assert sa.inspect(conn).has_table("durable_beat_schedule")
        command.downgrade(alembic_config(store_url, conn), "0012_broker_bindings")
        assert current_revision(conn) == "0012_broker_bindings"
        assert not sa.inspect(conn).has_table("durable_beat_schedule")
        command.upgrade(alembic_config(store_url, conn), "0013_beat_schedule")
        assert current_revision(conn) == "0013_beat_schedule"
        assert sa.inspect(conn).has_table("durable_beat_schedule")
