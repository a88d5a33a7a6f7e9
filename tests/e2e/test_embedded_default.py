"""The README's main job: the example app on the embedded default broker, no servers needed."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.e2e.harness import REPO


def test_the_demo_runs_tasks_on_the_embedded_sqlite_broker(tmp_path):
    env = dict(os.environ)
    # The embedded default, in a folder of the test's own so runs do not share a broker file.
    # No DURABLE_BROKER_URL: the broker is the default one, durable+<the store's URL>.
    env.pop("DURABLE_BROKER_URL", None)
    env["DURABLE_RESULT_URL"] = f"db+sqlite:///{tmp_path}/results.sqlite"
    env["DURABLE_STORE_URL"] = f"sqlite:///{tmp_path}/store.sqlite"
    done = subprocess.run([sys.executable, "examples/demo.py"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"broker:  durable+sqlite:///{tmp_path}/store.sqlite" in done.stdout
    assert "ran 34 tasks on 3 queues" in done.stdout
    assert "durable.worker.capacity capacity=4" in done.stdout
    # The outbox and a durable task on the embedded default: the message a row of the order's transaction.
    assert "committed order fulfilled by a durable task: {'order': 1, 'charge': 'ch_1'" in done.stdout
    assert "rolled-back order's task never sent (state PENDING)" in done.stdout
    # A durable beat replica on the same embedded default: its heartbeat ticks each sent once and run.
    assert "heartbeat ticks sent once each and run" in done.stdout, done.stdout
    assert "the replica released its lease on SIGTERM and exited 0" in done.stdout
    assert "worker drained on SIGTERM and exited 0" in done.stdout
