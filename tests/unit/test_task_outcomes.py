"""What each task signal counts: labels off the request, eager calls skipped, a worker-side failure counted once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from celery_durable import shared_dir
from celery_durable.metrics.registry import REGISTRY
from celery_durable.worker import task_outcomes as outcomes

HOST = "w1@unit"
QUEUE = "outcomes-q"


@pytest.fixture(autouse=True)
def _alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(shared_dir.ENV_VAR, raising=False)  # this process's table only


def _task(name: str, task_id: str = "t-1", eager: bool = False) -> Any:
    request = SimpleNamespace(id=task_id, hostname=HOST, delivery_info={"routing_key": QUEUE}, is_eager=eager)
    return SimpleNamespace(name=name, request=request)


def _value(metric: str, name: str, **extra: str) -> float:
    labels = {"name": name, "hostname": HOST, "queue_name": QUEUE, **extra}
    return REGISTRY.get_sample_value(metric, labels) or 0.0


def test_a_success_counts_once_and_observes_celerys_runtime():
    outcomes.on_success(sender=_task("unit.ok"), result=1, runtime=0.3)
    assert _value("celery_task_succeeded_total", "unit.ok") == 1
    assert _value("celery_task_runtime_count", "unit.ok") == 1
    assert _value("celery_task_runtime_bucket", "unit.ok", le="0.25") == 0
    assert _value("celery_task_runtime_bucket", "unit.ok", le="0.5") == 1
    assert _value("celery_task_runtime_sum", "unit.ok") == pytest.approx(0.3)
    # The outcomes it did not have are there at 0, for ratios.
    assert REGISTRY.get_sample_value("celery_task_retried_total",
                                     {"name": "unit.ok", "hostname": HOST, "queue_name": QUEUE}) == 0


def test_without_celerys_runtime_it_is_measured_from_prerun():
    task = _task("unit.old-celery", task_id="t-old")
    outcomes.on_prerun(sender=task, task_id="t-old")
    outcomes.on_success(sender=task, result=1)
    assert _value("celery_task_runtime_count", "unit.old-celery") == 1
    assert 0 <= _value("celery_task_runtime_sum", "unit.old-celery") < 5


def test_an_eager_call_is_not_counted():
    outcomes.on_success(sender=_task("unit.eager", eager=True), result=1, runtime=0.1)
    outcomes.on_failure(sender=_task("unit.eager", eager=True), task_id="t-1", exception=ValueError())
    assert _value("celery_task_succeeded_total", "unit.eager") == 0
    assert _value("celery_task_failed_total", "unit.eager", exception="ValueError") == 0


def test_a_raised_failure_and_a_retry_count_with_their_labels():
    task = _task("unit.bad")
    outcomes.on_failure(sender=task, task_id="t-1", exception=KeyError("x"))
    outcomes.on_retry(sender=task, request=task.request, reason="later")
    assert _value("celery_task_failed_total", "unit.bad", exception="KeyError") == 1
    assert _value("celery_task_retried_total", "unit.bad") == 1


def test_a_failure_the_worker_process_signals_twice_for_one_request_counts_once():
    # A hard time limit: the job's error callback, then the timeout callback, each send task_failure.
    request = SimpleNamespace(id="t-limit", name="unit.slow", hostname=HOST, delivery_info={"routing_key": QUEUE})
    not_running = SimpleNamespace(name="unit.slow", request=SimpleNamespace(id=None))
    with outcomes.settling(request):
        outcomes.on_failure(sender=not_running, task_id="t-limit", exception=TimeoutError())
    with outcomes.settling(request):
        outcomes.on_failure(sender=not_running, task_id="t-limit", exception=TimeoutError())
    assert _value("celery_task_failed_total", "unit.slow", exception="TimeoutError") == 1


def test_a_revoke_counts_with_the_requests_labels():
    context = SimpleNamespace(id="t-rev", task="unit.revoked", hostname=HOST, delivery_info={"routing_key": QUEUE})
    outcomes.on_revoked(sender=None, request=context, terminated=False, expired=True)
    assert _value("celery_task_revoked_total", "unit.revoked") == 1


def test_names_past_the_limit_are_served_as_other_and_an_admitted_name_keeps_its_own():
    from celery_durable.metrics import tasks as metrics

    labels = {"hostname": HOST, "queue_name": QUEUE}
    REGISTRY.get_sample_value("celery_task_succeeded_total", {"name": "x", **labels})  # a scrape: admits the seen
    room_for_one = len(metrics._names.admitted) + 1
    metrics.set_names_limit(room_for_one)
    try:
        outcomes.on_success(sender=_task("unit.limit-a"), result=1, runtime=0.1)
        outcomes.on_success(sender=_task("unit.limit-b"), result=1, runtime=0.1)
        assert _value("celery_task_succeeded_total", "unit.limit-a") == 1
        assert _value("celery_task_succeeded_total", "unit.limit-b") == 0
        other = _value("celery_task_succeeded_total", "other")
        assert other >= 1 and _value("celery_task_runtime_count", "other") == other
        # More of the admitted name: still under its own label, not moved to other.
        outcomes.on_success(sender=_task("unit.limit-a"), result=1, runtime=0.1)
        assert _value("celery_task_succeeded_total", "unit.limit-a") == 2
        assert _value("celery_task_succeeded_total", "other") == other
    finally:
        metrics.set_names_limit(100)
