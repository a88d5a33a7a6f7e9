"""The shipped pytest plugin, used as a user's project uses it: a toy project's own test session, run by pytest.

Each scenario writes a small project (an app module and its tests) and runs
pytest on it in a subprocess, so the plugin's fixtures, Celery's worker globals
and the logging setup of one session cannot leak into this one.
"""

from __future__ import annotations

import textwrap

import pytest

pytest_plugins = ["pytester"]

TOY_APP = '''
import logging
import os
import threading

from celery import Celery

import celery_durable

app = Celery("toyproj")  # no broker, no result backend: the plugin gives both
celery_durable.install(app)
log = logging.getLogger("toyproj.tasks")


@app.task
def where(word):
    log.warning("task says %s", word)
    return {"pid": os.getpid(), "thread": threading.current_thread().name, "word": word}


@app.durable_task
def checkout(order):
    charge = celery_durable.step("charge", lambda: {"order": order, "amount": order * 10})
    return {"charged": charge["amount"]}
'''


def _project(pytester: pytest.Pytester, tests: str) -> None:
    pytester.makepyfile(toyproj=TOY_APP, test_toy=textwrap.dedent(tests))


def _run(pytester: pytest.Pytester, passed: int) -> pytest.RunResult:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "--durations=0", "-o", "addopts=",
                                           timeout=240)
    result.assert_outcomes(passed=passed)
    return result


def test_each_test_reaches_its_own_broker_and_gets_its_results_back(pytester: pytest.Pytester) -> None:
    # The second test's broker is another file: before the plugin dropped the app's cached connections,
    # its task went to the first test's broker and .get() timed out.
    _project(pytester, '''
        import pytest
        from toyproj import where

        @pytest.mark.parametrize("name", ["first", "second"])
        def test_a_worker_on_its_own_broker(durable_worker, tmp_path, name):
            durable_worker("toyproj", broker_url=f"durable+sqlite:///{tmp_path / name}.sqlite")
            assert where.delay(name).get(timeout=30)["word"] == name

        def test_the_embedded_broker_after_them(durable_worker, durable_run):
            durable_worker("toyproj")
            assert where.delay("third").get(timeout=30)["word"] == "third"
    ''')
    _run(pytester, passed=3)


def test_in_process_workers_run_the_tasks_on_the_test_process_threads(pytester: pytest.Pytester) -> None:
    _project(pytester, '''
        import os
        import threading

        import pytest
        from toyproj import app, checkout, where

        @pytest.mark.parametrize("word", ["one", "two", "three"])
        def test_in_process(durable_worker, durable_run, word):
            durable_worker(app, in_process=True)
            seen = where.delay(word).get(timeout=30)
            assert seen["pid"] == os.getpid() and seen["thread"] != threading.current_thread().name
            sent = checkout.delay(7)
            assert sent.get(timeout=30) == {"charged": 70}
            run = durable_run(sent.id, state="succeeded")
            assert [(s.name, s.result) for s in run.steps] == [("charge", {"order": 7, "amount": 70})]

        def test_a_subprocess_worker_after_them(durable_worker):
            durable_worker("toyproj")
            assert where.delay("four").get(timeout=30)["pid"] != os.getpid()

        def test_one_in_process_worker_at_a_time(durable_worker):
            durable_worker(app, in_process=True)
            with pytest.raises(RuntimeError, match="already running"):
                durable_worker(app, in_process=True)
    ''')
    _run(pytester, passed=5)


def test_celery_start_worker_forwards_the_durable_pool_childrens_logs_to_caplog(pytester: pytest.Pytester) -> None:
    # Celery's embedded test worker forwards pool children's log records only for a pool class in a
    # module named ...prefork; -P durable's prefork pool lives in celery_durable.worker.prefork.
    _project(pytester, '''
        import os

        import pytest
        from celery.contrib.testing.worker import start_worker
        from toyproj import app, where

        @pytest.fixture
        def worker(tmp_path):
            app.conf.update(broker_url=f"durable+sqlite:///{tmp_path}/broker.sqlite", result_backend="rpc://",
                            durable_database_url=f"sqlite:///{tmp_path}/broker.sqlite")
            with start_worker(app, pool="durable", concurrency=1, perform_ping_check=False,
                              loglevel="INFO") as started:
                yield started

        def test_a_child_log_record_reaches_caplog(worker, caplog):
            assert where.delay("from the child").get(timeout=30)["pid"] != os.getpid()
            assert "task says from the child" in [r.getMessage() for r in caplog.records]
    ''')
    _run(pytester, passed=1)
