"""Moving off kombu's SQLAlchemy broker: ``celery durable broker migrate-from-sqla`` moves the waiting messages
of an ``sqla+`` database into the broker that claims rows, in order; a real worker on the new broker runs them.
A message an old consumer took and never acked stays until asked for (its task may have run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa

from celery_durable.broker import register
from celery_durable.store.engine import ensure_schema
from tests.e2e.harness import REPO, Scenario, wait_for


def _migrate(new_broker: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "E2E_BROKER": new_broker}
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.e2e.e2eapp", "durable", "broker",
                           "migrate-from-sqla", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_the_waiting_messages_move_in_order_and_run_on_the_new_broker_the_taken_one_when_asked(tmp_path: Path):
    register()
    old = f"sqla+sqlite:///{tmp_path / 'old-broker.sqlite'}"
    new_db = f"sqlite:///{tmp_path / 'new-broker.sqlite'}"
    ensure_schema(new_db)
    s = Scenario("sqla", old, ["a"])
    try:
        for i in range(4):
            s.send("a", f"m{i}")
        # m0 was taken by a worker that was killed: kombu's transport left it invisible for good.
        old_engine = sa.create_engine(old.removeprefix("sqla+"))
        with old_engine.begin() as conn:
            conn.execute(sa.text("UPDATE kombu_message SET visible = :no "
                                 "WHERE id = (SELECT min(id) FROM kombu_message)"), {"no": False})
        refused = _migrate(old, old)
        assert refused.returncode == 2 and "broker_url" in refused.stderr, refused.stderr

        done = _migrate(f"durable+{new_db}", old, "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        assert json.loads(done.stdout) == {"moved": {s.by_name["a"]: 3}, "taken_left": 1, "unreadable": 0}

        worker = s.worker(queues=["a"], concurrency=1, broker_url=f"durable+{new_db}").wait_ready()
        wait_for(lambda: len(s.ended()) == 3, timeout=30, what="the three moved tasks to run")
        assert [e["label"] for e in s.ended()] == ["m1", "m2", "m3"]  # in the order they were sent

        again = _migrate(f"durable+{new_db}", old, "--include-taken")
        assert again.returncode == 0, again.stdout + again.stderr
        assert again.stdout.splitlines()[0] == f"moved 1 messages ({s.by_name['a']} 1)"
        wait_for(lambda: s.labelled("end", "m0"), timeout=30, what="the taken message to run once moved")
        with old_engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM kombu_message")).scalar() == 0
        old_engine.dispose()
        assert worker.terminate() == 0
    finally:
        s.cleanup()
