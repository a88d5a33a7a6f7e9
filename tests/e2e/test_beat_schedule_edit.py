"""Editing the durable beat's schedule at run time, end to end: ``celery durable schedule add|edit|remove``
against a running ``celery beat -S celery_durable.Scheduler`` replica and a real ``-P durable`` worker
(PostgreSQL store, Redis broker). The replica is never restarted: the leader reads the stored entries
each round, at most ``durable_beat_lease_ttl / 3`` apart."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner

import celery_durable
from celery_durable.cli import durable
from celery_durable.store import beat as beat_store
from celery_durable.store.engine import engine_for
from tests.e2e.durable_support import conf, durable_scenario  # noqa: F401 - durable_scenario is a fixture
from tests.e2e.harness import Scenario, wait_for
from tests.e2e.test_durable_beat import BEAT, TTL, _beat_conf, _fires, _schedule_command, _started

#: How soon a change is run, by the docs (docs/beat.md): in the leader's next round, at most TTL / 3
#: after the command returns, plus the round's own time (one second here, on a loaded 2-core host).
TAKES_EFFECT = timedelta(seconds=TTL / 3 + 1.0)


def _fired(url: str, entry: str) -> list[tuple[datetime, datetime]]:
    """(tick, sent at) of each send of ``entry``, by tick."""
    with engine_for(url).connect() as conn:
        rows = conn.execute(beat_store.fires.select().where(beat_store.fires.c.beat == BEAT,
                                                            beat_store.fires.c.entry == entry)
                            .order_by(beat_store.fires.c.tick)).mappings().all()
    return [(row["tick"], row["fired_at"]) for row in rows]


def _now() -> datetime:
    return datetime.now(timezone.utc)


@pytest.mark.long
def test_entries_added_edited_paused_and_removed_by_the_cli_take_effect_without_a_restart(durable_scenario):
    s, url = durable_scenario("postgresql", "redis")
    s.worker(conf=conf(url), queues=["q"], concurrency=4, app="tests.e2e.beatapp").wait_ready()
    code = {"steady": {"every": 1}}
    replica = s.beat(conf=_beat_conf(url), entries=code).wait_started()
    wait_for(lambda: len(_fires(url, "steady")) >= 2, timeout=15, what="the code's entry to send")

    def command(*args: str) -> str:
        done = _schedule_command(s, url, code, *args)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    # Added: sent from the leader's next round on, on its own schedule, and run by the worker.
    assert command("add", "added", "--task", "beat.tick", "--every", "1", "--args", '["added"]',
                   "--queue", s.queues[0]) == "added: added"
    added_at = _now()
    wait_for(lambda: len(_fired(url, "added")) >= 3, timeout=15, what="the added entry to send three ticks")
    ticks = [tick for tick, _ in _fired(url, "added")]
    assert ticks[0] <= added_at + TAKES_EFFECT + timedelta(seconds=1), (ticks[0], added_at)
    assert all(b - a == timedelta(seconds=1) for a, b in zip(ticks, ticks[1:])), ticks
    wait_for(lambda: len(_started(s, "added")) >= 3, timeout=15, what="the worker to run the added sends")
    listed = json.loads(command("list", "--json"))
    assert {e["entry"]: e["source"] for e in listed["entries"]} == {"steady": "code", "added": "stored"}

    # Edited: every 2 s from the leader's next round on.
    assert command("edit", "added", "--every", "2") == "added: edited"
    edited_at = _now()
    settled = edited_at + TAKES_EFFECT
    wait_for(lambda: sum(1 for tick, _ in _fired(url, "added") if tick > settled) >= 3, timeout=20,
             what="three sends on the edited schedule")
    after = [tick for tick, _ in _fired(url, "added") if tick > settled]
    assert all(b - a == timedelta(seconds=2) for a, b in zip(after, after[1:])), after

    # Paused and resumed, as an entry of code is.
    assert command("pause", "added") == "added: paused"
    paused_at = _now()
    steady = len(_fires(url, "steady"))
    wait_for(lambda: len(_fires(url, "steady")) >= steady + 4, timeout=15, what="four more rounds")
    assert not [t for t, sent in _fired(url, "added") if sent > paused_at + TAKES_EFFECT], "nothing sent paused"
    assert command("resume", "added") == "added: resumed"
    resumed = len(_fired(url, "added"))
    wait_for(lambda: len(_fired(url, "added")) >= resumed + 1, timeout=15, what="a send after resume")

    # Removed: nothing sent once the leader's next round ends.
    assert command("remove", "added") == "added: removed"
    removed_at = _now()
    steady = len(_fires(url, "steady"))
    wait_for(lambda: len(_fires(url, "steady")) >= steady + 5, timeout=15, what="five more rounds")
    late = [sent for _, sent in _fired(url, "added") if sent > removed_at + TAKES_EFFECT]
    assert not late, f"sent after the remove took effect: {late}"
    listed = json.loads(command("list", "--json"))
    assert [e["entry"] for e in listed["entries"]] == ["steady"]

    log = replica.log()
    assert replica.process.poll() is None and log.count("durable.beat.started") == 1, "never restarted"
    for event in ("stored_entry_added", "stored_entry_edited", "stored_entry_removed"):
        assert f"durable.beat.{event} beat={BEAT} entry=added" in log, event


def _beat_app(s: Scenario, url: str) -> Celery:
    """The app tests/e2e/beatapp.py builds from the environment ``_schedule_command`` gives it, with E2E_BEAT
    ``{"steady": {"every": 1}}``, built in this process."""
    app = celery_durable.install(Celery("e2e", broker=s.broker_url, set_as_current=False))
    app.conf.update(task_default_queue=s.queues[0], **conf(url))

    # Not shared: a shared task would be added to every app made after it in this process.
    @app.task(name="beat.tick", shared=False)
    def tick(entry: str) -> str:
        return entry

    app.conf.beat_schedule = {"steady": {"task": "beat.tick", "schedule": 1.0, "args": ["steady"],
                                         "options": {"queue": s.queues[0]}}}
    return app


def _schedule_in_process(app: Celery, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery durable schedule *args`` run by click in this process: the same command function, app and
    store as ``_schedule_command``'s, without a Python start and an import of the app per call."""
    result = CliRunner().invoke(durable, ["schedule", *args],
                                obj=CLIContext(app=app, no_color=True, workdir=None, quiet=True))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["celery", "durable", "schedule", *args], result.exit_code,
                                       result.stdout, result.stderr)


def test_the_cli_refuses_the_apps_own_entries_and_bad_fields_naming_them(durable_scenario):
    s, url = durable_scenario("sqlite", "redis")
    code: dict[str, Any] = {"steady": {"every": 1}}
    cases = [
        (("edit", "steady", "--every", "3"), "Error: schedule entry 'steady': it is in the app's beat_schedule, "
                                             "read-only here (change it in code); edit refused"),
        (("remove", "steady"), "Error: schedule entry 'steady': it is in the app's beat_schedule, read-only here "
                               "(change it in code); remove refused"),
        (("add", "steady", "--task", "beat.tick", "--every", "1"),
         "Error: schedule entry 'steady': an entry of that name is in the app's beat_schedule, read-only here "
         "(change it in code); add refused"),
        (("add", "x", "--task", "beat.tick", "--crontab", "99 * * * *"),
         "Error: schedule entry 'x': crontab '99 * * * *' is not a crontab line (minute hour day-of-month month "
         "day-of-week): Invalid end range: 99 > 59."),
        (("add", "x", "--task", "beat.tick", "--every", "1", "--kwargs", "[1]"),
         "Error: schedule entry 'x': kwargs must be a JSON object (string keys), got [1]"),
        (("edit", "ghost", "--every", "1"), "Error: no stored schedule entry named 'ghost' (stored: none); "
                                            "edit refused"),
    ]
    # The real command once (exit status, one line on stderr, no traceback, through `celery -A app`); every
    # case, that one too, through the same command function in this process: a Python start and an import
    # of the app per case is ~6 s of CI each.
    (first_args, first_said), = cases[:1]
    done = _schedule_command(s, url, code, *first_args)
    assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (1, first_said), (first_args, done.stderr)
    assert "Traceback" not in done.stderr
    app = _beat_app(s, url)
    for args, said in cases:
        done = _schedule_in_process(app, *args)
        assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (1, said), (args, done.stderr)
        assert "Traceback" not in done.stderr
    unknown = _schedule_in_process(app, "add", "remote", "--task", "only.workers.know", "--every", "5")
    assert unknown.returncode == 0 and unknown.stdout.strip() == "remote: added", unknown.stderr
    assert "task 'only.workers.know' is not registered in this app: it is sent by name" in unknown.stderr
    text = _schedule_in_process(app, "list").stdout
    assert any(line.split()[:3] == ["remote", "stored", "only.workers.know"] for line in text.splitlines()), text
    assert any(line.split()[:3] == ["steady", "code", "beat.tick"] for line in text.splitlines()), text
    app.close()
