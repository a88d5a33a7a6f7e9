"""``celery durable runs``: every verb against a real store (PostgreSQL and SQLite), its bad input and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import sqlalchemy as sa

from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.planning.checkpoints import StepKey
from celery_durable.store import run_reads
from celery_durable.store import runs as store_runs
from celery_durable.store import steps as store_steps
from celery_durable.store.engine import engine_for
from celery_durable.store.schema import DEAD, SUCCEEDED
from tests.e2e.durable_support import conf, durable_scenario  # noqa: F401 - durable_scenario is a fixture
from tests.e2e.harness import REPO, Scenario, wait_for

APP = "tests.e2e.durableapp"


def _runs(s: Scenario, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "E2E_BROKER": s.broker_url, "E2E_QUEUES": ",".join(s.queues),
           "E2E_CONF": json.dumps(conf(url)), "E2E_KEY": s.key}
    return subprocess.run([sys.executable, "-m", "celery", "-A", APP, "durable", "runs", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def _seed(url: str, run_id: str, state: str, *, task: str = "durable.three_steps", finished_days_ago: float = 0,
          steps: int = 0) -> None:
    """A run as a worker would have left it: started, ``steps`` checkpoints, then settled in ``state``."""
    with engine_for(url).begin() as conn:
        run, _ = store_runs.begin_attempt(conn, run_id=run_id, task_name=task, queue=None, args='["x"]',
                                          kwargs="{}", token=f"t-{run_id}", lease_seconds=30)
        for n in range(steps):
            # Written under the attempt's own lease, as a worker's checkpoints are (the insert is fenced by it).
            assert store_steps.insert(conn, run_id, StepKey(f"s{n + 1}", 0), json.dumps({"n": n, "pad": "x" * 40}),
                                      f"t-{run_id}")
        if state != "running":
            store_runs.settle(conn, run, state, result='"done"' if state == SUCCEEDED else None,
                              error="ValueError('boom')" if state == DEAD else None)
        if finished_days_ago:
            at = SYSTEM_CLOCK.now() - timedelta(days=finished_days_ago)
            conn.execute(sa.update(store_runs.runs).where(store_runs.runs.c.id == run_id)
                         .values(finished_at=at, updated_at=at))


@pytest.mark.parametrize("store_kind", ["postgresql", "sqlite"])
def test_list_show_cancel_and_purge_on_a_real_store(durable_scenario, store_kind):
    s, url = durable_scenario(store_kind, "redis")
    _seed(url, "ok-old", SUCCEEDED, finished_days_ago=40, steps=2)
    _seed(url, "ok-new", SUCCEEDED, steps=1)
    _seed(url, "dead-old", DEAD, finished_days_ago=40)
    _seed(url, "live", "running")

    listed = _runs(s, url, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {row["id"]: row["state"] for row in json.loads(listed.stdout)} == \
        {"ok-old": "succeeded", "ok-new": "succeeded", "dead-old": "dead", "live": "running"}
    dead = json.loads(_runs(s, url, "list", "--state", "dead", "--json").stdout)
    assert [(row["id"], row["last_error"]) for row in dead] == [("dead-old", "ValueError('boom')")]
    recent = json.loads(_runs(s, url, "list", "--since", "1d", "--json").stdout)
    assert {row["id"] for row in recent} == {"ok-new", "live"}

    shown = json.loads(_runs(s, url, "show", "ok-old", "--json").stdout)
    assert [(step["name"], step["result_bytes"]) for step in shown["steps"]] == \
        [("s1", len(json.dumps({"n": 0, "pad": "x" * 40}))), ("s2", len(json.dumps({"n": 1, "pad": "x" * 40})))]
    assert "step s1#0" in _runs(s, url, "show", "ok-old").stdout

    cancelled = _runs(s, url, "cancel", "live")
    assert (cancelled.returncode, cancelled.stdout.strip()) == (0, "live: cancelled"), cancelled.stderr
    again = _runs(s, url, "cancel", "live")
    assert again.returncode == 3 and "is cancelled already" in again.stderr

    purged = _runs(s, url, "purge", "--older-than", "30d")
    assert purged.returncode == 0 and purged.stdout.startswith("purged 1 run(s)"), purged.stdout + purged.stderr
    left = {row["id"] for row in json.loads(_runs(s, url, "list", "--json").stdout)}
    assert left == {"ok-new", "dead-old", "live"}, "a dead run is kept unless asked"
    assert _runs(s, url, "purge", "--older-than", "30d", "--include-dead").stdout.startswith("purged 1 run(s)")
    with engine_for(url).connect() as conn:
        assert run_reads.steps_of(conn, "ok-old") == [], "a purged run's steps go with it"


@pytest.mark.parametrize("store_kind", ["postgresql", "sqlite"])
def test_requeue_sends_a_dead_run_again_and_a_worker_runs_it(durable_scenario, store_kind):
    s, url = durable_scenario(store_kind, "redis")
    _seed(url, "dead-1", DEAD, task="durable.three_steps")
    _seed(url, "dead-2", DEAD, task="durable.three_steps")
    _seed(url, "done", SUCCEEDED)
    one = _runs(s, url, "requeue", "dead-1")
    assert (one.returncode, one.stdout.strip()) == (0, "dead-1: requeued"), one.stderr
    refused = _runs(s, url, "requeue", "done")
    assert refused.returncode == 3 and "only a dead run" in refused.stderr
    every = _runs(s, url, "requeue", "--all-dead", "--task", "durable.three_steps")
    assert every.returncode == 0 and every.stdout.strip() == "dead-2: requeued", every.stdout + every.stderr
    s.open_gate("x", count=2)  # the task waits for its label's gate on a run's first attempt: let both through
    s.worker(app=APP, conf=conf(url), queues=["q"], concurrency=2).wait_ready()
    wait_for(lambda: all(json.loads(_runs(s, url, "show", run_id, "--json").stdout)["state"] == "succeeded"
                         for run_id in ("dead-1", "dead-2")), timeout=60, what="both requeued runs to succeed")


@pytest.mark.parametrize(("args", "code", "named"), [
    (["show", "nope"], 3, "no durable run has id 'nope'"),
    (["cancel", "nope"], 3, "no durable run has id 'nope'"),
    (["requeue", "nope"], 3, "no durable run has id 'nope'"),
    (["purge", "--older-than", "30 days"], 2, "'30 days' is not a duration"),
    (["list", "--since", "-1h"], 2, "'-1h' is not a duration"),
    (["list", "--state", "asleep"], 2, "'asleep' is not one of"),
    (["requeue"], 2, "give a run id, or --all-dead"),
    # Before: an OverflowError's traceback (a timedelta, an SQL LIMIT), exit 1.
    (["list", "--since", "99999999999999999999d"], 2, "is longer than the longest duration taken, 36500d"),
    (["purge", "--older-than", "99999999999999999999d"], 2, "is longer than the longest duration taken"),
    (["list", "--limit", "99999999999999999999"], 2, "99999999999999999999 is not in the range"),
])
def test_bad_input_is_one_line_naming_it_with_an_exit_code_scripts_can_use(durable_scenario, args, code, named):
    s, url = durable_scenario("sqlite", "redis")
    done = _runs(s, url, *args)
    assert done.returncode == code, done.stdout + done.stderr
    assert named in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_store_url_that_does_not_parse_is_named(durable_scenario):
    s, _ = durable_scenario("sqlite", "redis")
    done = _runs(s, "not a url", "list")
    assert done.returncode == 1 and "durable_database_url" in done.stderr and "Traceback" not in done.stderr


def test_a_worker_deletes_settled_runs_past_their_retention_and_keeps_the_rest(durable_scenario):
    s, url = durable_scenario("postgresql", "redis")
    _seed(url, "ok-old", SUCCEEDED, finished_days_ago=3, steps=1)
    _seed(url, "ok-new", SUCCEEDED)
    _seed(url, "dead-old", DEAD, finished_days_ago=3)
    _seed(url, "live", "running")
    worker = s.worker(app=APP, conf=conf(url, durable_run_retention=86400), queues=["q"], concurrency=2)
    worker.wait_ready()

    def left() -> set[str]:
        return {row["id"] for row in json.loads(_runs(s, url, "list", "--json").stdout)}

    wait_for(lambda: "ok-old" not in left(), timeout=30, what="the worker to purge the run past its retention")
    assert left() == {"ok-new", "dead-old", "live"}
    assert "durable.runs.purged runs=1" in worker.log()
