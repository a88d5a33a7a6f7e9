"""compat.autoretry: the copy of Celery's autoretry decision agrees with Celery's own wrapper."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Retry

from celery_durable.compat.autoretry import max_retries, will_retry


class Transient(Exception):
    pass


class Final(Transient):
    pass


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("compat-autoretry", broker="memory://", set_as_current=False)
    yield app
    app.close()


def _task(app: Celery, **options: Any) -> Any:
    @app.task(name=f"compat.autoretry.{len(app.tasks)}", shared=False, bind=True,
              autoretry_for=(Transient,), dont_autoretry_for=(Final,), **options)
    def failing(self: Any, exc: BaseException) -> None:
        raise exc

    return failing


def _celery_retries(task: Any, exc: BaseException, retries: int) -> tuple[bool, bool]:
    """(compat.will_retry's prediction, whether Celery's autoretry wrapper then retried) at ``retries``."""
    task.push_request(retries=retries, called_directly=False, is_eager=False, id="compat-autoretry-run")
    try:
        # As execution asks it: inside the body, before the wrapper has seen the error.
        predicted = will_retry(task, exc)
        task.apply_async = lambda *args, **kwargs: None
        try:
            task.run(exc)
        except Retry:
            return predicted, True
        except type(exc):
            return predicted, False
        raise AssertionError("the body always raises")
    finally:
        task.pop_request()


@pytest.mark.parametrize(("exc", "retries", "limit"), [
    (Transient("x"), 0, 3), (Transient("x"), 2, 3), (Transient("x"), 3, 3), (Transient("x"), 9, None),
    (Final("x"), 0, 3), (KeyError("x"), 0, 3),
])
def test_will_retry_agrees_with_celerys_autoretry(app: Celery, exc: BaseException, retries: int,
                                                  limit: int | None) -> None:
    task = _task(app, max_retries=limit)
    predicted, retried = _celery_retries(task, exc, retries)
    assert predicted == retried
    assert retried == (isinstance(exc, Transient) and not isinstance(exc, Final) and (limit is None or retries < limit))


def test_task_retry_max_retries_overrides_the_tasks_own_as_autoretry_reads_it(app: Celery) -> None:
    task = _task(app, max_retries=1)
    assert max_retries(task) == 1
    task.push_request(retries=3, called_directly=False, is_eager=False, id="compat-autoretry-override")
    try:
        task.apply_async = lambda *args, **kwargs: None
        with pytest.raises(Retry):
            task.retry(max_retries=5, countdown=0)
        # Task.retry keeps it on the instance (override_max_retries) until the autoretry wrapper deletes it.
        assert max_retries(task) == 5
        assert will_retry(task, Transient("x"))
    finally:
        task.pop_request()
