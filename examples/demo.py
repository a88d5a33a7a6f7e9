"""Runs the example app end to end: a real ``-P durable`` worker, a producer, a SIGTERM drain.

Also a durable task enqueued through the transactional outbox: an order committed with its task
is fulfilled (two checkpointed steps); an order rolled back never sends its task.

    python examples/demo.py            # the embedded default: no servers needed
    DURABLE_BROKER_URL=redis://127.0.0.1:6379/0 python examples/demo.py

Exits non-zero if any task did not complete or the worker did not drain cleanly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import sqlalchemy as sa  # noqa: E402

from celery_durable import outbox  # noqa: E402
from examples.proj import add, app, build_report, fulfil, send_email  # noqa: E402

READY_TIMEOUT = 60.0
RESULT_TIMEOUT = 120.0


def start_worker(log_path: Path) -> subprocess.Popen[bytes]:
    log = open(log_path, "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "examples.proj", "worker", "-P", "durable",
         "-Q", "default,emails,reports", "-l", "info", "--without-mingle", "--without-gossip"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def start_beat(log_path: Path) -> subprocess.Popen[bytes]:
    log = open(log_path, "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "examples.proj", "beat", "-S", "celery_durable.Scheduler",
         "-l", "info"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def beat_ticks(at_least: int, since: float) -> list[tuple[str, str]]:
    """Wait for ``at_least`` heartbeat sends fired after ``since`` (Unix time) to have run; returns
    (tick, task id) of each of them (an earlier demo's, kept in the same store, are left out)."""
    from celery_durable.store import beat as beat_store
    from celery_durable.store.engine import engine_for

    deadline = time.monotonic() + RESULT_TIMEOUT
    while True:
        with engine_for(app.conf.durable_database_url).connect() as conn:
            sent = [(tick.isoformat(), task_id) for _, tick, task_id, _ in beat_store.fired(conn, "proj", "heartbeat")
                    if tick.timestamp() >= since]
        if len(sent) >= at_least and all(app.AsyncResult(task_id).state == "SUCCESS" for _, task_id in sent):
            return sent
        if time.monotonic() > deadline:
            sys.exit(f"the beat's heartbeat did not run {at_least} times in {RESULT_TIMEOUT:.0f}s")
        time.sleep(0.2)


def wait_ready(worker: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while " ready." not in log_path.read_text(errors="replace"):
        if worker.poll() is not None:
            sys.exit(f"the worker exited with {worker.returncode}; see {log_path}")
        if time.monotonic() > deadline:
            worker.kill()
            sys.exit(f"the worker was not ready after {READY_TIMEOUT:.0f}s; see {log_path}")
        time.sleep(0.05)


def enqueue_orders() -> tuple[str, str]:
    """One order committed with its fulfil task, one rolled back with its own: (kept id, dropped id)."""
    engine = sa.create_engine(app.conf.durable_database_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS demo_orders (id INTEGER PRIMARY KEY, item TEXT)")
        conn.exec_driver_sql("DELETE FROM demo_orders")
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO demo_orders (id, item) VALUES (1, 'book')")
        kept = outbox.enqueue(conn, fulfil.s(1))
    with engine.connect() as conn:
        trans = conn.begin()
        conn.exec_driver_sql("INSERT INTO demo_orders (id, item) VALUES (2, 'lamp')")
        dropped = outbox.enqueue(conn, fulfil.s(2))
        trans.rollback()
    engine.dispose()
    return kept.id, dropped.id


def main() -> int:
    log_path = REPO / "examples" / "worker.log"
    print(f"broker:  {app.conf.broker_url}")
    print(f"worker:  celery -A examples.proj worker -P durable -Q default,emails,reports  (log: {log_path})")
    worker = start_worker(log_path)
    beat_log = REPO / "examples" / "beat.log"
    beat = None
    try:
        wait_ready(worker, log_path)
        began = time.monotonic()
        results = (
            [add.delay(i, i) for i in range(20)]
            + [send_email.delay(f"user{i}@example.com") for i in range(10)]
            + [build_report.delay(f"q{i}") for i in range(4)]
        )
        values = [r.get(timeout=RESULT_TIMEOUT) for r in results]
        elapsed = time.monotonic() - began
        kept_id, dropped_id = enqueue_orders()
        # On the embedded default the committed message is a row of the order's own transaction (elsewhere
        # the worker's outbox relay publishes the committed outbox row); the rolled-back one never existed.
        fulfilled = app.AsyncResult(kept_id).get(timeout=RESULT_TIMEOUT)
        dropped_state = app.AsyncResult(dropped_id).state
        print(f"beat:    celery -A examples.proj beat -S celery_durable.Scheduler  (log: {beat_log})")
        beat_started = time.time()
        beat = start_beat(beat_log)
        ticks = beat_ticks(at_least=3, since=beat_started)
        beat.send_signal(signal.SIGTERM)
        beat_code = beat.wait(timeout=30)
    except BaseException:
        worker.kill()
        if beat is not None:
            beat.kill()
        raise
    expected = [i + i for i in range(20)]
    ok = values[:20] == expected and len(values) == 34
    print(f"ran {len(values)} tasks on 3 queues in {elapsed:.2f}s: "
          f"{values[0]}, {values[20]!r}, {values[-1]!r} ...")
    ok = ok and fulfilled["charge"] == "ch_1" and dropped_state == "PENDING"
    print(f"outbox:  committed order fulfilled by a durable task: {fulfilled}; "
          f"rolled-back order's task never sent (state {dropped_state})")
    ok = ok and beat_code == 0 and len({task_id for _, task_id in ticks}) == len(ticks)
    print(f"beat:    {len(ticks)} heartbeat ticks sent once each and run (first {ticks[0][0]}); "
          f"the replica released its lease on SIGTERM and exited {beat_code}")
    for line in log_path.read_text(errors="replace").splitlines():
        if "durable.worker.capacity" in line:
            print("worker:  " + line.split("] ", 1)[-1])
    worker.send_signal(signal.SIGTERM)
    code = worker.wait(timeout=60)
    print(f"worker drained on SIGTERM and exited {code}")
    return 0 if ok and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
