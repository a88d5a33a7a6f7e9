"""celery_durable's pytest plugin: a ``-P durable`` worker, a throw-away store, and runs to assert on.

Installed with the package (entry point ``pytest11``), so a project's own tests
can write::

    def test_fulfil_charges_once(durable_worker, durable_run):
        durable_worker("proj.tasks", queues=["default"])      # a real worker, the embedded broker
        result = fulfil.delay(7)
        assert result.get(timeout=10)["order"] == 7          # a result backend is set unless the app has one
        run = durable_run(result.id, state="succeeded")      # polls the store with a deadline
        assert [step.name for step in run.steps] == ["charge", "receipt"]

Fixtures:

- ``durable_store``: a throw-away SQLite durable store (``.url``) for the test,
  already migrated (a copy of one migrated once per session).
- ``durable_embedded_broker_url``: the test's embedded broker, ``durable+sqlite:///``
  on the store's own file (rows claimed under leases, no server): nothing one
  test sent reaches the next.
- ``durable_worker(app, *, queues=None, concurrency=2, broker_url=None, conf=None, in_process=False)``:
  a ready ``-P durable`` worker of ``app`` on ``broker_url`` or the embedded
  broker, with the test's store, ``result_backend = "rpc://"`` when the app
  configures none, and ``conf`` over all of it; the app in the test process is
  pointed at the same settings (and back, with its cached connections dropped,
  at teardown), so what the test sends reaches the worker and its results come
  back. By default the worker is a real ``celery worker`` subprocess, stopped
  with SIGTERM at teardown (the test fails if it did not exit cleanly); with
  ``in_process=True`` it is Celery's embedded worker on a thread of the test
  process, its tasks on threads (``durable_execution = "threads"``): no
  subprocess, no second import of the app, a worker in well under a second.
- ``durable_run(task_id, *, state=None, timeout=30)``: the run as the store
  holds it (``state``, ``attempts``, ``result``, ``last_error``, ``steps``);
  with ``state`` it waits until the run is in it, and says what it was instead.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from celery_durable.testing.app_settings import TestAppSettings, settings_for_test
from celery_durable.testing.in_process import InProcessWorker
from celery_durable.testing.records import RunRecord, StepRecord, read_run
from celery_durable.testing.subprocess_worker import DurableWorker, start_subprocess_worker

__all__ = ["DurableStore", "DurableWorker", "InProcessWorker", "RunRecord", "StepRecord", "find_app", "read_run"]


@dataclass(frozen=True)
class DurableStore:
    """A durable store for one test: ``url`` is what ``durable_database_url`` is set to."""

    url: str


def find_app(app: Any) -> tuple[Any, str]:
    """The Celery app and the ``-A`` string for ``app`` (an import string such as ``"proj.tasks"``)."""
    if not isinstance(app, str):
        raise TypeError(f"durable_worker needs the app as celery -A takes it (e.g. 'proj.tasks'), got {app!r}")
    from celery.app.utils import find_app as celery_find_app

    return celery_find_app(app), app


@pytest.fixture(scope="session")
def durable_store_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SQLite file migrated to the current schema once per session: each test's store starts as a copy."""
    from celery_durable.store.engine import ensure_schema

    path = tmp_path_factory.mktemp("durable-store-template") / "store.sqlite"
    ensure_schema(f"sqlite:///{path}").dispose()
    return path


@pytest.fixture
def durable_store(durable_store_template: Path, tmp_path: Path) -> DurableStore:
    """A throw-away SQLite durable store for this test (migrated already)."""
    path = tmp_path / "durable-store.sqlite"
    shutil.copyfile(durable_store_template, path)
    return DurableStore(url=f"sqlite:///{path}")


@pytest.fixture
def durable_embedded_broker_url(durable_store: DurableStore) -> str:
    """The embedded broker for the test: ``durable+sqlite:///`` on the store's own file, as the example app does."""
    return f"durable+{durable_store.url}"


@pytest.fixture
def durable_worker(durable_store: DurableStore, durable_embedded_broker_url: str,
                   tmp_path: Path) -> Iterator[Callable[..., DurableWorker | InProcessWorker]]:
    """``durable_worker(app, *, queues=None, concurrency=2, broker_url=None, conf=None, in_process=False)``."""
    subprocesses: list[DurableWorker] = []
    embedded: list[InProcessWorker] = []
    applied: list[TestAppSettings] = []

    def start(app: Any, *, queues: Sequence[str] | None = None, concurrency: int = 2, broker_url: str | None = None,
              conf: dict[str, Any] | None = None, in_process: bool = False) -> DurableWorker | InProcessWorker:
        celery_app, app_path = (app, None) if in_process and not isinstance(app, str) else find_app(app)
        settings = settings_for_test(celery_app.conf, broker_url=broker_url or durable_embedded_broker_url,
                                     store_url=durable_store.url, conf=conf or {}, in_process=in_process)
        # The test's own process sends to the same broker, reads the same store and backend.
        applied.append(TestAppSettings(celery_app, settings))
        node_name = f"durable-test-{os.getpid()}-{len(subprocesses) + len(embedded)}@%h"
        if in_process:
            worker = InProcessWorker(celery_app, queues=queues, concurrency=concurrency, node_name=node_name)
            embedded.append(worker)
            return worker
        assert app_path is not None
        started = start_subprocess_worker(app_path, settings, queues=queues, concurrency=concurrency,
                                          node_name=node_name,
                                          log_path=tmp_path / f"durable-worker-{len(subprocesses)}.log")
        subprocesses.append(started)
        started.wait_ready()
        return started

    yield start
    failures = []
    for worker in embedded:
        try:
            worker.stop()
        except Exception as err:  # noqa: BLE001 - every worker is stopped; the test fails naming each
            failures.append(f"the in-process durable worker did not stop: {err!r}")
    for started in subprocesses:
        code = started.stop()
        if code != 0:
            failures.append(f"the durable worker exited with {code}:\n{started.log()[-3000:]}")
    for settings in reversed(applied):
        settings.restore()
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
