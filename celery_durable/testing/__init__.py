"""celery_durable's pytest plugin: a real ``-P durable`` worker, a throw-away store, and runs to assert on.

Installed with the package (entry point ``pytest11``), so a project's own tests
can write::

    def test_fulfil_charges_once(durable_worker, durable_run):
        durable_worker("proj.tasks", queues=["default"])      # a real worker, the embedded broker
        result = fulfil.delay(7)
        run = durable_run(result.id, state="succeeded")      # polls the store with a deadline
        assert [step.name for step in run.steps] == ["charge", "receipt"]

Fixtures:

- ``durable_store``: a throw-away SQLite durable store (``.url``) for the test.
- ``durable_worker(app, *, queues=None, concurrency=2, broker_url=None, conf=None)``:
  starts ``celery -A app worker -P durable`` as a subprocess on the given broker,
  or on the embedded default (an SQLite file of the test session, no server),
  with the test's store; the app in the test process is pointed at the same
  broker and store, so what the test sends reaches the worker. Waits until
  the worker is ready; stops it with SIGTERM at teardown and fails the test if
  it did not exit cleanly.
- ``durable_run(task_id, *, state=None, timeout=30)``: the run as the store
  holds it (``state``, ``attempts``, ``result``, ``last_error``, ``steps``);
  with ``state`` it waits until the run is in it, and says what it was instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: How long a worker may take to say it is ready, and to exit after SIGTERM.
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0


@dataclass(frozen=True)
class DurableStore:
    """A durable store for one test: ``url`` is what ``durable_database_url`` is set to."""

    url: str


@dataclass(frozen=True)
class StepRecord:
    name: str
    #: How many steps of the same name ran before it in the run (0 for the first).
    occurrence: int
    result: Any


@dataclass(frozen=True)
class RunRecord:
    id: str
    task_name: str
    state: str
    attempts: int
    result: Any
    last_error: str | None
    #: The run's completed steps, in the order they were checkpointed.
    steps: list[StepRecord]


class DurableWorker:
    """A running ``celery worker -P durable`` subprocess."""

    def __init__(self, process: subprocess.Popen[bytes], log_path: Path) -> None:
        self.process = process
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while " ready." not in self.log():
            if self.process.poll() is not None:
                raise AssertionError(f"the durable worker exited with {self.process.returncode}:\n"
                                     f"{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the durable worker was not ready after {timeout:.0f}s:\n"
                                     f"{self.log()[-3000:]}")
            time.sleep(0.05)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM (a warm shutdown: running runs finish) and the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"the durable worker did not exit within {timeout:.0f}s of SIGTERM:\n"
                                 f"{self.log()[-3000:]}") from None


def find_app(app: Any) -> tuple[Any, str]:
    """The Celery app and the ``-A`` string for ``app`` (an import string such as ``"proj.tasks"``)."""
    if not isinstance(app, str):
        raise TypeError(f"durable_worker needs the app as celery -A takes it (e.g. 'proj.tasks'), got {app!r}")
    from celery.app.utils import find_app as celery_find_app

    return celery_find_app(app), app


def read_run(url: str, task_id: str) -> RunRecord | None:
    """The run ``task_id`` as the store at ``url`` holds it, or None if it has none."""
    from celery_durable.store import runs as store_runs
    from celery_durable.store import steps as store_steps
    from celery_durable.store.engine import ensure_schema
    from celery_durable.store.json_values import from_json

    engine = ensure_schema(url)
    with engine.connect() as conn:
        run = store_runs.get(conn, task_id)
        if run is None:
            return None
        stored = store_steps.load(conn, task_id)
    steps = [StepRecord(key.name, key.occurrence, from_json(encoded)) for key, encoded in stored.items()]
    return RunRecord(id=run.id, task_name=run.task_name, state=run.state, attempts=run.attempts,
                     result=from_json(run.result), last_error=run.last_error, steps=steps)


@pytest.fixture
def durable_store(tmp_path: Path) -> DurableStore:
    """A throw-away SQLite durable store for this test."""
    return DurableStore(url=f"sqlite:///{tmp_path / 'durable-store.sqlite'}")


@pytest.fixture(scope="session")
def durable_embedded_broker_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The embedded default broker (``durable+sqlite:///``: rows claimed under leases, on an SQLite file) for
    the test session.

    One per session: an app's producer pool keeps the broker it first connected
    to, so the broker stays the same across tests.
    """
    return f"durable+sqlite:///{tmp_path_factory.mktemp('durable-broker') / 'broker.sqlite'}"


@pytest.fixture
def durable_worker(durable_store: DurableStore, durable_embedded_broker_url: str,
                   tmp_path: Path) -> Iterator[Callable[..., DurableWorker]]:
    """``durable_worker(app, *, queues=None, concurrency=2, broker_url=None, conf=None)``: a ready worker."""
    started: list[DurableWorker] = []

    def start(app: str, *, queues: Sequence[str] | None = None, concurrency: int = 2,
              broker_url: str | None = None, conf: dict[str, Any] | None = None) -> DurableWorker:
        celery_app, app_path = find_app(app)
        settings: dict[str, Any] = {
            "broker_url": broker_url or durable_embedded_broker_url,
            "durable_database_url": durable_store.url,
            **(conf or {}),
        }
        # The test's own process sends to the same broker and reads the same store.
        celery_app.conf.update(settings)
        log_path = tmp_path / f"durable-worker-{len(started)}.log"
        argv = [sys.executable, "-m", "celery_durable.testing.launch", app_path, json.dumps(settings),
                "worker", "-P", "durable", "-c", str(concurrency), "-l", "info",
                "--without-mingle", "--without-gossip", "-n", f"durable-test-{os.getpid()}-{len(started)}@%h"]
        if queues:
            argv += ["-Q", ",".join(queues)]
        # The app must import in the worker as it does here (pytest puts the rootdir on sys.path).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *filter(None, sys.path)])}
        with open(log_path, "wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        worker = DurableWorker(process, log_path)
        started.append(worker)
        worker.wait_ready()
        return worker

    yield start
    failures = []
    for worker in started:
        code = worker.stop()
        if code != 0:
            failures.append(f"the durable worker exited with {code}:\n{worker.log()[-3000:]}")
    if failures:
        pytest.fail("\n".join(failures))


@pytest.fixture
def durable_run(durable_store: DurableStore) -> Callable[..., RunRecord]:
    """``durable_run(task_id, *, state=None, timeout=30)``: the run in the test's store."""

    def look(task_id: str, *, state: str | None = None, timeout: float = 30.0) -> RunRecord:
        from celery_durable.store.schema import STATES

        if state is not None and state not in STATES:
            raise ValueError(f"durable_run: state must be one of {', '.join(STATES)}, got {state!r}")
        deadline = time.monotonic() + timeout
        while True:
            run = read_run(durable_store.url, task_id)
            if run is not None and (state is None or run.state == state):
                return run
            if state is None or time.monotonic() > deadline:
                seen = "no run" if run is None else f"state {run.state!r} (last error: {run.last_error})"
                wanted = f"in state {state!r} " if state else ""
                raise AssertionError(f"durable run {task_id} {wanted}not found within {timeout:.0f}s: {seen}")
            time.sleep(0.05)

    return look
