"""Processes writing one SQLite store file take turns at its write lock: every write lands, a wait is
bounded by the busy timeout, and a wait that runs out names the setting (real files, real processes)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_durable.planning.checkpoints import StepKey
from celery_durable.store import engine as store_engine
from celery_durable.store import runs, sqlite_lock_wait, steps
from celery_durable.store.engine import autocommit, dispose_all, ensure_schema

#: A run's hot path, as a pool child writes it: start, three checkpoints, settle, each its own statement.
WRITER = textwrap.dedent("""
    import sys
    from celery_durable.planning.checkpoints import StepKey
    from celery_durable.store import runs, steps
    from celery_durable.store.engine import autocommit, engine_for
    url, who, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print("ready", flush=True)
    sys.stdin.readline()
    with autocommit(engine_for(url)).connect() as conn:
        for i in range(count):
            run_id = f"{who}-{i}"
            run, _ = runs.begin_attempt(conn, run_id=run_id, task_name="t", queue="q", args="[]", kwargs="{}",
                                        token=run_id, lease_seconds=30)
            for name in "abc":
                steps.insert(conn, run_id, StepKey(name, 0), "1", run_id)
            runs.settle(conn, run, "succeeded", result="1")
    print("done", flush=True)
""")

#: Holds SQLite's write lock on a file (BEGIN IMMEDIATE) until a line comes on stdin.
HOLDER = textwrap.dedent("""
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    print("held", flush=True)
    sys.stdin.readline()
    conn.execute("COMMIT")
    print("released", flush=True)
""")


def _started(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _said(process: subprocess.Popen[str], word: str) -> None:
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    assert line == word, f"expected {word!r}, got {line!r}; stderr: {process.stderr.read() if process.stderr else ''}"


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    ensure_schema(url)
    dispose_all()
    yield url
    dispose_all()


@pytest.fixture
def holder(url: str) -> Iterator[subprocess.Popen[str]]:
    process = _started(HOLDER, sa.engine.make_url(url).database or "")
    _said(process, "held")
    yield process
    if process.poll() is None:
        process.kill()
        process.wait()


def test_two_processes_writing_runs_to_one_file_land_every_write(url: str):
    count = 300
    writers = [_started(WRITER, url, who, str(count)) for who in ("one", "two")]
    for writer in writers:
        _said(writer, "ready")
    for writer in writers:  # both go at once: they contend for the write lock throughout
        assert writer.stdin is not None
        writer.stdin.write("go\n")
        writer.stdin.flush()
    for writer in writers:
        out, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err
        assert out.strip() == "done"
    with autocommit(ensure_schema(url)).connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM durable_runs WHERE state = 'succeeded'").scalar() == 2 * count
        assert conn.exec_driver_sql("SELECT count(*) FROM durable_steps").scalar() == 6 * count


def test_a_write_waits_for_the_lock_another_process_releases(url: str, holder: subprocess.Popen[str],
                                                             monkeypatch: pytest.MonkeyPatch):
    refused = threading.Event()
    real_sleep = time.sleep

    def pause(seconds: float) -> None:  # the wait's first pause: the write has been refused at least once
        refused.set()
        real_sleep(seconds)

    monkeypatch.setattr(sqlite_lock_wait.time, "sleep", pause)
    outcome: dict[str, object] = {}

    def write() -> None:
        with autocommit(ensure_schema(url)).connect() as conn:
            outcome["run"] = runs.begin_attempt(conn, run_id="r1", task_name="t", queue="q", args="[]",
                                                kwargs="{}", token="k1", lease_seconds=30)

    writer = threading.Thread(target=write)
    writer.start()
    assert refused.wait(timeout=5), "the write was never refused: the lock was not held"
    assert holder.stdin is not None
    holder.stdin.write("commit\n")
    holder.stdin.flush()
    _said(holder, "released")
    writer.join(timeout=store_engine.SQLITE_BUSY_TIMEOUT_MS / 1000)
    assert not writer.is_alive()
    run, fresh = outcome["run"]  # type: ignore[misc]
    assert fresh and run.state == "running"


def test_a_wait_past_the_busy_timeout_fails_naming_the_setting(url: str, holder: subprocess.Popen[str],
                                                              monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(store_engine, "SQLITE_BUSY_TIMEOUT_MS", 300)
    dispose_all()  # connections made from now on take the shorter timeout
    with autocommit(store_engine.engine_for(url)).connect() as conn:
        started = time.monotonic()
        with pytest.raises(sa.exc.OperationalError) as raised:
            steps.insert(conn, "r1", StepKey("a", 0), "1", "k1")
        waited = time.monotonic() - started
        assert 0.3 <= waited < 3.0  # the configured total, not SQLite's default nor forever
        assert "SQLITE_BUSY_TIMEOUT_MS" in str(raised.value) and "300 ms" in str(raised.value)
        assert "database is locked" in str(raised.value)  # still read as the store being out of reach
        # Nothing was written, and the connection works once the lock is free.
        assert holder.stdin is not None
        holder.stdin.write("commit\n")
        holder.stdin.flush()
        _said(holder, "released")
        assert conn.exec_driver_sql("SELECT count(*) FROM durable_steps").scalar() == 0


def test_inside_a_transaction_a_refused_write_fails_at_once(url: str, holder: subprocess.Popen[str]):
    # A read transaction cannot become a write one by waiting (its snapshot may be stale): SQLite's own
    # handler does not wait there either, and neither do we; the caller's transaction fails whole.
    raw = store_engine.engine_for(url).raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("BEGIN")
        cursor.execute("SELECT count(*) FROM durable_runs")
        started = time.monotonic()
        with pytest.raises(Exception, match="locked"):
            cursor.execute("DELETE FROM durable_runs")
        assert time.monotonic() - started < 1.0
        cursor.execute("ROLLBACK")
    finally:
        raw.close()
