"""compat.task_signals: whether ``task_success`` carries the runtime, pinned against the installed Celery's tracer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, signals

from celery_durable.compat.task_signals import success_carries_runtime


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("task-signals", broker="memory://", set_as_current=False)
    yield app
    app.close()


def test_the_installed_celerys_task_success_carries_the_runtime_as_claimed(app: Celery) -> None:
    @app.task(name="task_signals.noop", shared=False)
    def noop() -> None:
        return None

    seen: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    signals.task_success.connect(receiver, weak=False)
    try:
        noop.apply()
    finally:
        signals.task_success.disconnect(receiver)
    (sent,) = seen
    assert isinstance(sent.get("runtime"), float) is success_carries_runtime()


@pytest.mark.parametrize(("version", "carries"), [((5, 5), False), ((5, 6), False), ((5, 7), True), ((6, 0), True)])
def test_celery_5_7_and_later_carry_it(version: tuple[int, int], carries: bool) -> None:
    assert success_carries_runtime(version) is carries
