"""The durable beat end to end: real ``celery beat -S celery_durable.Scheduler`` replicas, a real
``-P durable`` worker counting what it is sent by task id, a PostgreSQL store, Redis and RabbitMQ."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta
from typing import Any

import pytest

from celery_durable.store import beat as beat_store
from celery_durable.store.engine import engine_for
from tests.e2e.durable_support import conf, durable_scenario  # noqa: F401 - durable_scenario is a fixture
from tests.e2e.harness import REPO, BeatProcess, Scenario, wait_for
from tests.e2e.metrics_ports import free_port, metrics_text

APP = "tests.e2e.beatapp"
BEAT = "e2e"  # the beat's name: the app's main module name (beatapp builds on e2eapp's Celery("e2e"))
TTL = 3.0


def _leader(url: str) -> beat_store.Leadership | None:
    with engine_for(url).connect() as conn:
        return beat_store.leadership(conn, BEAT)


def _leading(url: str, replicas: list[BeatProcess]) -> BeatProcess:
    """The replica holding a live lease now (waits for one)."""

    def find() -> BeatProcess | None:
        lead = _leader(url)
        if lead is None or lead.expires_at < datetime.now(lead.expires_at.tzinfo):
            return None
        return next((r for r in replicas if r.holder == lead.holder and r.process.poll() is None), None)

    return wait_for(find, timeout=TTL + 5, what="a replica to lead", every=0.05)


def _fires(url: str, entry: str) -> list[tuple[datetime, str, int]]:
    with engine_for(url).connect() as conn:
        return [(tick, task_id, term) for _, tick, task_id, term in beat_store.fired(conn, BEAT, entry)]


def _fired_at(url: str, entry: str) -> list[datetime]:
    with engine_for(url).connect() as conn:
        rows = conn.execute(beat_store.fires.select().where(beat_store.fires.c.entry == entry)
                            .order_by(beat_store.fires.c.fired_at)).mappings().all()
    return [row["fired_at"] for row in rows]


def _started(s: Scenario, entry: str) -> list[dict[str, Any]]:
    return [e for e in s.events() if e["e"] == "start" and e["label"] == entry]


def _beat_conf(url: str, **extra: Any) -> dict[str, Any]:
    return conf(url, **{"durable_beat_lease_ttl": TTL, **extra})


# Leadership and fencing live in the store; the broker only carries the outbox's sends: a message broker's
# (Redis; RabbitMQ's publish of outbox rows is proven by test_outbox_relay.py and the outbox integration
# tests) and the rows broker's, where the send is a row of the same database.
@pytest.mark.long
@pytest.mark.parametrize("broker_kind", ["redis", "postgresql"])
def test_three_replicas_send_every_tick_once_through_two_kills_and_a_sigterm(durable_scenario, broker_kind):
    """An entry every second for a minute; the leader SIGKILLed twice and SIGTERMed once (a fresh
    replica started after each, on no local state): every tick in the window is sent exactly once —
    counted by task id at the worker — and no two sends are more than TTL + 1 s apart."""
    s, url = durable_scenario("postgresql", broker_kind)
    s.worker(conf=conf(url), queues=["q"], concurrency=4, app=APP).wait_ready()
    entries = {"every1": {"every": 1}}
    replicas = [s.beat(conf=_beat_conf(url), entries=entries).wait_started() for _ in range(3)]
    started = time.monotonic()
    exits: list[int] = []
    for at, how in ((12, signal.SIGKILL), (27, signal.SIGKILL), (42, signal.SIGTERM)):
        wait_for(lambda at=at: time.monotonic() - started >= at, timeout=at + 5, what=f"{at} s", every=0.1)
        leader = _leading(url, replicas)
        if how == signal.SIGKILL:
            leader.kill()
        else:
            exits.append(leader.terminate())
        replicas.append(s.beat(conf=_beat_conf(url), entries=entries).wait_started())
    wait_for(lambda: time.monotonic() - started >= 60, timeout=65, what="the minute to pass", every=0.1)
    # The standbys first: stopping the leader first would hand the lease to one of them (a fifth term).
    leader = _leading(url, replicas)
    for replica in [r for r in replicas if r is not leader] + [leader]:
        if replica.process.poll() is None:
            assert replica.terminate() == 0
    fires = _fires(url, "every1")
    wait_for(lambda: len(_started(s, "every1")) >= len(fires), timeout=20, what="the worker to run every send")

    assert exits == [0], "a SIGTERMed replica exits 0"
    ticks = [tick for tick, _, _ in fires]
    assert len(ticks) >= 55, f"a minute of ticks, got {len(ticks)}"
    assert all(b - a == timedelta(seconds=1) for a, b in zip(ticks, ticks[1:])), "every tick, none skipped"
    sent = _started(s, "every1")
    assert sorted(e["id"] for e in sent) == sorted(task_id for _, task_id, _ in fires), "each tick sent once"
    assert len({e["id"] for e in sent}) == len(sent), "no task id ran twice"
    assert len({term for _, _, term in fires}) == 4, "four leaders: the first, and one after each stop"
    fired_at = _fired_at(url, "every1")
    gaps = [(b - a).total_seconds() for a, b in zip(fired_at, fired_at[1:])]
    assert max(gaps) <= TTL + 1.0, f"largest gap between sends {max(gaps):.2f} s"


@pytest.mark.long
def test_a_stale_leader_resumed_after_its_lease_moved_sends_nothing(durable_scenario):
    """The leader is stopped (SIGSTOP) past its TTL; a standby takes over; the old leader, resumed, finds
    the lease gone and sends nothing more. Every tick is still sent once."""
    s, url = durable_scenario("postgresql", "redis")
    s.worker(conf=conf(url), queues=["q"], concurrency=4, app=APP).wait_ready()
    entries = {"every1": {"every": 1}}
    replicas = [s.beat(conf=_beat_conf(url), entries=entries).wait_started() for _ in range(2)]
    stale = _leading(url, replicas)
    stale_term = (_leader(url) or beat_store.Leadership("", 0, datetime.min)).term
    wait_for(lambda: len(_fires(url, "every1")) >= 3, timeout=10, what="three sends")
    stale.signal(signal.SIGSTOP)
    standby = next(r for r in replicas if r is not stale)
    wait_for(lambda: (_leader(url) or beat_store.Leadership("", 0, datetime.min)).holder == standby.holder,
             timeout=TTL + 5, what="the standby to take over")
    # What the stale leader sent, by the store: once the standby leads, no send under the old term can
    # commit any more (a send locks the lease row and checks the term in its own transaction). Its log
    # is no measure at the stop: a send committed just before SIGSTOP logs its line after SIGCONT.
    sent_by_stale = {task_id for _, task_id, term in _fires(url, "every1") if term == stale_term}
    assert sent_by_stale, "the stale leader had sent ticks before it was stopped"
    new_term = (_leader(url) or beat_store.Leadership("", 0, datetime.min)).term
    # The stale leader stays stopped while the new one sends three ticks under its term.
    wait_for(lambda: sum(1 for *_, term in _fires(url, "every1") if term == new_term) >= 3, timeout=10,
             what="three sends by the new leader")
    stale.signal(signal.SIGCONT)
    wait_for(lambda: "durable.beat.not_leading" in stale.log(), timeout=10,
             what="the resumed replica to find it no longer leads")
    wait_for(lambda: len(_fires(url, "every1")) >= 3 + 2 * int(TTL) + 3, timeout=15, what="more sends")
    assert {task_id for _, task_id, term in _fires(url, "every1") if term == stale_term} == sent_by_stale, \
        "the stale leader sent nothing once resumed"
    logged = {line.split(" id=")[1].split()[0] for line in stale.log().splitlines() if "durable.beat.fired" in line}
    assert logged <= sent_by_stale, f"the stale leader logged sends the store does not hold: {logged - sent_by_stale}"
    fires = _fires(url, "every1")
    ticks = [tick for tick, _, _ in fires]
    assert all(b - a == timedelta(seconds=1) for a, b in zip(ticks, ticks[1:]))
    wait_for(lambda: len(_started(s, "every1")) >= len(fires), timeout=10, what="every send to run")
    assert sorted(e["id"] for e in _started(s, "every1")) == sorted(task_id for _, task_id, _ in fires)


def _caught_up(replica: BeatProcess) -> dict[str, tuple[datetime, datetime]]:
    """Per entry, the missed span the replica's catch-up log line names."""
    spans = {}
    for line in replica.log().splitlines():
        if "durable.beat.caught_up" in line:
            fields = dict(part.split("=", 1) for part in line.split("durable.beat.caught_up ")[1].split())
            spans[fields["entry"]] = (datetime.fromisoformat(fields["missed_from"]),
                                      datetime.fromisoformat(fields["missed_to"]))
    return spans


@pytest.mark.long
def test_each_catch_up_policy_sends_what_it_promises_after_a_30_second_outage(durable_scenario):
    """Four entries every second, one per policy; every replica stopped for 30 s, then one started on a
    fresh process: "none" sends nothing it missed, "skip" only the latest missed tick, "run_once" one
    send standing for them all (the first, naming the span), "all" every one; each then goes on."""
    s, url = durable_scenario("postgresql", "redis")
    s.worker(conf=conf(url), queues=["q"], concurrency=4, app=APP).wait_ready()
    policies = ("none", "skip", "run_once", "all")
    entries = {policy: {"every": 1, "catch_up": policy} for policy in policies}
    first = s.beat(conf=_beat_conf(url, durable_beat_lease_ttl=1.0), entries=entries).wait_started()
    wait_for(lambda: all(len(_fires(url, p)) >= 3 for p in policies), timeout=15, what="three sends of each")
    assert first.terminate() == 0
    before = {p: _fires(url, p) for p in policies}
    down = time.monotonic()
    wait_for(lambda: time.monotonic() - down >= 30, timeout=35, what="a 30 s outage", every=0.2)
    second = s.beat(conf=_beat_conf(url, durable_beat_lease_ttl=1.0), entries=entries).wait_started()
    wait_for(lambda: set(_caught_up(second)) == set(policies), timeout=10, what="each entry to catch up")
    wait_for(lambda: all(len(_fires(url, p)) >= len(before[p]) + 4 for p in policies), timeout=15,
             what="each entry to go on after its catch-up")
    assert second.terminate() == 0
    spans = _caught_up(second)
    for policy in policies:
        last_before = before[policy][-1][0]
        missed_from, missed_to = spans[policy]
        assert missed_from == last_before + timedelta(seconds=1), policy
        missed = round((missed_to - missed_from).total_seconds()) + 1
        assert missed >= 25, f"{policy}: a 30 s outage misses most of its 30 ticks, the log says {missed}"
        after = [tick for tick, _, _ in _fires(url, policy)][len(before[policy]):]
        in_span = [tick for tick in after if tick <= missed_to]
        on_time = [tick for tick in after if tick > missed_to]
        assert on_time and on_time[0] == missed_to + timedelta(seconds=1), f"{policy}: goes on from the span"
        assert all(b - a == timedelta(seconds=1) for a, b in zip(on_time, on_time[1:])), policy
        expected = {"none": [], "skip": [missed_to], "run_once": [missed_from],
                    "all": [missed_from + timedelta(seconds=i) for i in range(missed)]}[policy]
        assert in_span == expected, f"{policy}: sent {len(in_span)} of the {missed} missed"
    fires = [f for p in policies for f in _fires(url, p)]
    wait_for(lambda: len(s.started()) >= len(fires), timeout=15, what="the worker to run every send")
    assert sorted(e["id"] for e in s.started()) == sorted(task_id for _, task_id, _ in fires)
    run_once = [e for e in s.started() if e["label"] == "run_once" and e["missed_from"] is not None]
    assert [(e["missed_from"], e["missed_to"]) for e in run_once] == \
        [(spans["run_once"][0].isoformat(), spans["run_once"][1].isoformat())], "the catch-up send names its span"


@pytest.mark.parametrize(("spec", "named"), [
    ({"every1": {"every": 1, "catch_up": "later"}}, "entry 'every1': options durable_catch_up must be one of"),
    ({"ghost": {"raw": {"task": "no.such.task", "schedule": 1.0}}}, "entry 'ghost': task 'no.such.task' is not "
                                                                    "registered"),
    ({"cron": {"raw": {"task": "beat.tick", "schedule": "99 * * * *"}}}, "entry 'cron': schedule '99 * * * *' is "
                                                                       "not a crontab line"),
    ({"list": {"raw": {"task": "beat.tick", "schedule": [1]}}}, "entry 'list': schedule must be seconds, "
                                                               "a timedelta, a crontab"),
    ({"never": {"raw": {"task": "beat.tick", "schedule": -1}}}, "entry 'never': schedule of -1 seconds"),
])
def test_a_bad_schedule_entry_is_refused_at_start_naming_it(durable_scenario, spec, named):
    s, url = durable_scenario("postgresql", "redis")
    replica = s.beat(conf=_beat_conf(url), entries=spec)
    code = replica.wait_exit(timeout=30)
    text = replica.log()
    assert code == 1, text
    assert f"celery_durable beat refused to start: beat_schedule {named}" in text, text
    assert "Traceback" not in text, text


def _schedule_command(s: Scenario, url: str, entries: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "E2E_BROKER": s.broker_url, "E2E_QUEUES": ",".join(s.queues),
           "E2E_CONF": json.dumps(conf(url)), "E2E_KEY": s.key, "E2E_BEAT": json.dumps(entries)}
    return subprocess.run([sys.executable, "-m", "celery", "-A", APP, "durable", "schedule", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.long
def test_an_operator_lists_pauses_resumes_and_triggers_entries_of_a_running_beat(durable_scenario):
    s, url = durable_scenario("postgresql", "redis")
    s.worker(conf=conf(url), queues=["q"], concurrency=4, app=APP).wait_ready()
    entries = {"paused1": {"every": 1}, "steady": {"every": 1}}
    replica = s.beat(conf=_beat_conf(url), entries=entries).wait_started()
    wait_for(lambda: len(_fires(url, "paused1")) >= 2, timeout=10, what="two sends")
    listed = _schedule_command(s, url, entries, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    report = json.loads(listed.stdout)
    assert report["leader"]["holder"] == replica.holder
    assert {e["entry"]: e["paused"] for e in report["entries"]} == {"paused1": False, "steady": False}

    paused = _schedule_command(s, url, entries, "pause", "paused1")
    assert (paused.returncode, paused.stdout.strip()) == (0, "paused1: paused"), paused.stderr
    sent_when_paused = len(_fires(url, "paused1"))
    steady = len(_fires(url, "steady"))
    wait_for(lambda: len(_fires(url, "steady")) >= steady + 3, timeout=10, what="three more rounds")
    assert len(_fires(url, "paused1")) <= sent_when_paused + 1, "at most the round in flight sends it"
    listed = json.loads(_schedule_command(s, url, entries, "list", "--json").stdout)
    assert [e for e in listed["entries"] if e["entry"] == "paused1"][0]["paused"] is True

    resumed_at = datetime.now().astimezone()
    assert _schedule_command(s, url, entries, "resume", "paused1").stdout.strip() == "paused1: resumed"
    wait_for(lambda: len(_fires(url, "paused1")) >= sent_when_paused + 3, timeout=10, what="sends after resume")
    after = [tick for tick, _, _ in _fires(url, "paused1")][sent_when_paused + 1:]
    assert after and min(after) > resumed_at, "the ticks that fell due while paused are not sent"

    triggered = _schedule_command(s, url, entries, "trigger", "paused1")
    assert triggered.returncode == 0, triggered.stderr
    task_id = triggered.stdout.strip()
    wait_for(lambda: any(e["id"] == task_id for e in _started(s, "paused1")), timeout=10,
             what="the triggered send to run")

    unknown = _schedule_command(s, url, entries, "pause", "nope")
    assert unknown.returncode == 1
    assert unknown.stderr.strip().splitlines()[-1] == \
        "Error: no schedule entry named 'nope' (entries: paused1, steady)"


def test_the_schedule_commands_work_on_the_embedded_sqlite_store_and_name_a_bad_store(durable_scenario):
    s, url = durable_scenario("sqlite", "redis")
    entries = {"every1": {"every": 1, "catch_up": "run_once"}}
    assert _schedule_command(s, url, entries, "pause", "every1").returncode == 0
    listed = json.loads(_schedule_command(s, url, entries, "list", "--json").stdout)
    assert listed["leader"] is None and listed["entries"][0]["paused"] is True
    assert listed["entries"][0]["catch_up"] == "run_once" and listed["entries"][0]["next_due"] is None
    text = _schedule_command(s, url, entries, "list").stdout
    assert "no replica leads now" in text and "every1" in text and "paused" in text
    bad = _schedule_command(s, "postgresql://nobody@127.0.0.1:1/none", entries, "list")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "is unavailable" in bad.stderr.strip().splitlines()[-1], bad.stderr


def test_each_replica_says_whether_it_leads_and_the_leader_how_late_each_entry_is(durable_scenario):
    s, url = durable_scenario("postgresql", "redis")
    ports = [free_port(), free_port()]
    replicas = [s.beat(conf=_beat_conf(url, durable_metrics_port=port), entries={"every1": {"every": 1}})
                .wait_started() for port in ports]
    leader = _leading(url, replicas)
    wait_for(lambda: len(_fires(url, "every1")) >= 2, timeout=10, what="two sends")
    texts = {replica: metrics_text(port) for replica, port in zip(replicas, ports)}
    for replica, text in texts.items():
        assert f'durable_beat_leader{{beat="{BEAT}"}} {1.0 if replica is leader else 0.0}' in text, text
    lead_text = texts[leader]
    fired = [line for line in lead_text.splitlines()
             if line.startswith(f'durable_beat_last_fire_timestamp{{beat="{BEAT}",entry="every1"}}')]
    assert fired and abs(float(fired[0].split()[-1]) - time.time()) < 5, lead_text
    lag = [line for line in lead_text.splitlines()
           if line.startswith(f'durable_beat_lag_seconds{{beat="{BEAT}",entry="every1"}}')]
    assert lag and 0.0 <= float(lag[0].split()[-1]) < 1.0, lead_text


def test_sighup_makes_a_replica_take_schedule_changes_without_a_restart(durable_scenario, tmp_path, monkeypatch):
    """The schedule changes under a running replica (an entry added, one removed, one's interval changed);
    SIGHUP: the replica finishes its round, gives its lease back and starts again in place (same pid),
    reading the new schedule."""
    s, url = durable_scenario("postgresql", "redis")
    schedule_file = tmp_path / "schedule.json"
    schedule_file.write_text(json.dumps({"kept": {"every": 1}, "dropped": {"every": 1}}))
    monkeypatch.setenv("E2E_BEAT_FILE", str(schedule_file))
    replica = s.beat(conf=_beat_conf(url))
    replica.wait_started()
    wait_for(lambda: len(_fires(url, "dropped")) >= 2 and len(_fires(url, "kept")) >= 2, timeout=10,
             what="both entries to send")
    schedule_file.write_text(json.dumps({"kept": {"every": 2}, "added": {"every": 1}}))
    pid = replica.process.pid
    replica.signal(signal.SIGHUP)
    wait_for(lambda: "durable.beat.reloading" in replica.log(), timeout=10, what="the replica to reload")
    wait_for(lambda: len(_fires(url, "added")) >= 3, timeout=15, what="the added entry to send")
    dropped = len(_fires(url, "dropped"))
    kept_before = len(_fires(url, "kept"))
    wait_for(lambda: len(_fires(url, "kept")) >= kept_before + 2, timeout=10, what="the changed entry to send")
    assert replica.process.poll() is None and replica.process.pid == pid
    assert len(_fires(url, "dropped")) == dropped, "a removed entry sends nothing more"
    kept = [tick for tick, _, _ in _fires(url, "kept")]
    assert kept[-1] - kept[-2] == timedelta(seconds=2), "a changed interval takes effect"
    assert replica.log().count("durable.beat.released") == 1 and replica.log().count("durable.beat.started") == 2


def test_a_store_behind_its_migrations_is_refused_in_one_line_naming_the_migrate_command(durable_scenario):
    from alembic import command

    from celery_durable.store.engine import HEAD_REVISION, alembic_config, current_revision

    s, url = durable_scenario("postgresql", "redis")
    with engine_for(url).begin() as conn:
        command.downgrade(alembic_config(url, conn), "-1")  # the store as the release before this one left it
        behind = current_revision(conn)
    assert behind is not None and behind != HEAD_REVISION
    replica = s.beat(conf=_beat_conf(url), entries={"every1": {"every": 1}})
    code = replica.wait_exit(timeout=30)
    text = replica.log()
    assert code == 1, text
    refusals = [line for line in text.splitlines() if "refused to start" in line]
    assert len(refusals) == 1, text
    assert "celery_durable beat refused to start: the durable store at " in refusals[0], text
    assert refusals[0].endswith(f"is at schema revision {behind}; this code needs {HEAD_REVISION}: "
                                "run `celery -A proj durable migrate`"), text
    assert "Traceback" not in text, text
