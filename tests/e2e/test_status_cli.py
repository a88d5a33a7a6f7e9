"""``celery durable status`` against a real worker, broker and store: one screen, and ``--json`` for scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import celery_durable
from celery_durable.store import runs as store_runs
from celery_durable.store.engine import engine_for
from celery_durable.store.schema import DEAD
from tests.e2e.durable_support import APP, conf, durable_scenario, effects  # noqa: F401 - a fixture
from tests.e2e.harness import REPO, Scenario, wait_for


def _status(s: Scenario, url: str, *args: str, broker: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "E2E_BROKER": broker or s.broker_url,
           "E2E_QUEUES": ",".join(s.queues), "E2E_CONF": json.dumps(conf(url)), "E2E_KEY": s.key}
    return subprocess.run([sys.executable, "-m", "celery", "-A", APP, "durable", "status", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)


def _dead_run(url: str, run_id: str, queue: str) -> None:
    with engine_for(url).begin() as conn:
        run, _ = store_runs.begin_attempt(conn, run_id=run_id, task_name="durable.doomed", queue=queue, args='["x"]',
                                          kwargs="{}", token=f"t-{run_id}", lease_seconds=30)
        store_runs.settle(conn, run, DEAD, error="ValueError('boom')")


@pytest.mark.parametrize(("store_kind", "broker_kind"), [("postgresql", "redis"), ("sqlite", "rabbitmq"),
                                                       ("postgresql", "postgresql"), ("sqlite", "sqlite")])
def test_status_shows_the_worker_its_queue_the_runs_and_the_outbox(durable_scenario, store_kind, broker_kind):
    s, url = durable_scenario(store_kind, broker_kind)
    if broker_kind != store_kind:
        celery_durable.install(s.producer)  # stamps send times, as a user's app does
    # On the broker that claims rows the age is read from the rows: a producer that stamps nothing is enough.
    q = s.by_name["q"]
    worker = s.worker(app=APP, conf=conf(url), concurrency=2, extra_args=["--queue-concurrency", f"{q}=1"]).wait_ready()
    holder = s.send_task("q", "durable.long_steps", ["hold", 20, 0.5])  # the one slot, for about 10 s
    wait_for(lambda: effects(url, holder).get("s0"), timeout=20, what="the holder's first step")
    for i in range(3):
        s.send_task("q", "durable.quick", [f"w{i}"])
    _dead_run(url, "dead-1", q)

    def shown() -> dict | None:
        done = _status(s, url, "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        snapshot = json.loads(done.stdout)
        queues = {queue["name"]: queue for queue in snapshot["queues"]}
        return snapshot if q in queues and queues[q]["depth"] == 3 else None

    snapshot = wait_for(shown, timeout=20, what="status to show the 3 waiting messages", every=0.2)
    [me] = [w for w in snapshot["workers"] if w["name"] == worker.hostname]
    assert (me["in_flight"], me["capacity"], me["held_by_queue"], me["queue_slots"]) == (1, 1, {q: 1}, {q: 1})
    [queue] = [each for each in snapshot["queues"] if each["name"] == q]
    assert queue["oldest_ready_seconds"] is not None and 0.0 < queue["oldest_ready_seconds"] < 60
    assert queue["dead_runs"] == 1
    assert snapshot["runs_by_state"]["dead"] == 1 and snapshot["runs_by_state"]["running"] >= 1
    assert snapshot["outbox_backlog"] == 0 and snapshot["problems"] == []

    screen = _status(s, url)
    assert screen.returncode == 0, screen.stderr
    lines = screen.stdout.splitlines()
    # The whole fleet on the broker shows (other tests' workers too): read this worker's and this queue's lines.
    assert lines[0].startswith("WORKERS  ") and " answering, " in lines[0], screen.stdout
    [worker_line] = [line for line in lines if line.split()[:1] == [worker.hostname]]
    assert worker_line.split()[1:] == ["1/1", q, "1/1"], worker_line
    [queue_line] = [line for line in lines if line.split()[:1] == [q]]
    assert queue_line.split()[1] == "3" and queue_line.split()[3] == "1", queue_line
    assert "OUTBOX   0 unpublished, oldest -" in lines and any(line.startswith("RUNS ") for line in lines)


def test_status_names_what_it_could_not_read_and_exits_1(durable_scenario):
    s, url = durable_scenario("sqlite", "redis")
    done = _status(s, url, "--timeout", "0.5", broker="redis://127.0.0.1:1/0")  # nothing listens on port 1
    assert done.returncode == 1, done.stdout + done.stderr
    assert "! the broker could not be read" in done.stdout and "RUNS" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr

    bad = _status(s, "not a url")
    assert bad.returncode == 1 and "durable_database_url" in bad.stderr and "Traceback" not in bad.stderr
