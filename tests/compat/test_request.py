"""compat.request: what the worker reads off Celery's ``Request``, on requests Celery's own strategy makes."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, signals
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from celery.worker.request import Request

from celery_durable.compat.request import cached_context, request_of_callback, skip_ack, waits_for_eta, was_acknowledged
from tests.compat.conftest import TaskMessage


class RecordingTimer:
    """The consumer's timer: records each ``call_at`` and whether the request already waited for its ETA then."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any, tuple[Any, ...]]] = []
        self.waiting_when_called: list[bool] = []

    def call_at(self, eta: Any, fun: Any, args: tuple[Any, ...] = (), kwargs: Any = None, priority: int = 0) -> Any:
        self.calls.append((eta, fun, args))
        self.waiting_when_called.append(waits_for_eta(args[0], in_pool=False))
        return SimpleNamespace(eta=eta, fun=fun, args=args)


class RecordingPool:
    """A pool that keeps what ``Request.execute_using_pool`` hands it."""

    def __init__(self) -> None:
        self.applied: list[dict[str, Any]] = []

    def apply_async(self, target: Any, **options: Any) -> Any:
        self.applied.append({"target": target, **options})
        return None


class StrategyHost:
    """The consumer attributes Celery's default strategy reads (``celery/worker/strategy.py``), rate limits off."""

    def __init__(self) -> None:
        self.hostname = "compat@test"
        self.connection_errors = ()
        self.event_dispatcher = None
        self.timer = RecordingTimer()
        self.disable_rate_limits = True
        self.task_buckets: dict[str, Any] = {}
        self.pool = RecordingPool()
        self.controller = SimpleNamespace(state=SimpleNamespace(revoked=set()))
        self.qos = SimpleNamespace(increment_eventually=lambda n=1: None, decrement_eventually=lambda n=1: None)
        self.handed_on: list[Any] = []

    def on_task_request(self, request: Any) -> None:
        self.handed_on.append(request)

    def apply_eta_task(self, request: Any) -> None:
        self.handed_on.append(request)

    def _limit_task(self, request: Any, bucket: Any, tokens: int) -> None:
        raise AssertionError("rate limits are off")

    def _limit_post_eta(self, request: Any, bucket: Any, tokens: int) -> None:
        raise AssertionError("rate limits are off")


@pytest.fixture
def receive(app: Celery, task_message: TaskMessage) -> Iterator[Any]:
    """``receive(sig, **options)``: (request, host) after Celery's strategy handled the message ``sig`` sends."""
    made: list[Any] = []

    def run(sig: Any, **options: Any) -> tuple[Any, StrategyHost]:
        message = task_message(sig, **options)
        host = StrategyHost()
        handler = app.tasks[sig.task].start_strategy(app, host)
        handler(message, None, message.ack_log_error, message.reject_log_error, [])
        requests = [args[0] for _, _, args in host.timer.calls] + host.handed_on
        assert len(requests) == 1, f"the strategy made {len(requests)} requests of one message"
        made.extend(requests)
        return requests[0], host

    yield run
    for request in made:
        # The strategy registers each request in the worker's module-global state.
        worker_state.task_ready(request)


#: Celery 5.7 records the ETA timer entry on the request; 5.5 and 5.6 do not, and compat goes by ``Request.eta``.
RECORDS_ETA_ENTRY = hasattr(Request, "_eta_timer_entry")
NO_ETA_ENTRY = "celery < 5.7 records no timer entry on the request (compat goes by Request.eta there)"


@pytest.mark.skipif(not RECORDS_ETA_ENTRY, reason=NO_ETA_ENTRY)
def test_request_eta_timer_entry_is_none_until_the_consumer_schedules_it(app: Celery, receive: Any) -> None:
    request, host = receive(app.tasks["compat.add"].s(1, 2), countdown=60)
    [(_, fun, args)] = host.timer.calls
    assert fun == host.apply_eta_task and args == (request,)
    assert host.timer.waiting_when_called == [False]
    # The strategy stores what the timer's call_at returned, before it returns.
    assert request._eta_timer_entry is not None
    assert request._eta_timer_entry.args == (request,)
    assert waits_for_eta(request, in_pool=False)


@pytest.mark.skipif(not RECORDS_ETA_ENTRY, reason=NO_ETA_ENTRY)
def test_request_eta_timer_entry_stays_none_without_an_eta(app: Celery, receive: Any) -> None:
    request, host = receive(app.tasks["compat.add"].s(1, 2))
    assert host.timer.calls == [] and host.handed_on == [request]
    # The class attribute compat falls back to: nothing set on the instance.
    assert Request._eta_timer_entry is None and "_eta_timer_entry" not in vars(request)
    assert not waits_for_eta(request, in_pool=True)


@pytest.mark.parametrize("when", ["countdown", "past-eta"])
def test_strategy_puts_every_request_with_an_eta_on_the_timer(app: Celery, receive: Any, when: str) -> None:
    # What compat reads on every release: a request with an ETA is timed, a past one
    # included, and is not handed on (so never in the pool) when the strategy returns.
    options: dict[str, Any] = ({"countdown": 60} if when == "countdown"
                               else {"eta": datetime.now(timezone.utc) - timedelta(seconds=60)})
    request, host = receive(app.tasks["compat.add"].s(1, 2), **options)
    [(_, fun, args)] = host.timer.calls
    assert fun == host.apply_eta_task and args == (request,)
    assert host.handed_on == []
    assert request.eta is not None
    assert waits_for_eta(request, in_pool=False)


def test_strategy_hands_on_every_request_without_an_eta_at_once(app: Celery, receive: Any) -> None:
    request, host = receive(app.tasks["compat.add"].s(1, 2))
    assert host.timer.calls == [] and host.handed_on == [request]
    assert request.eta is None
    assert not waits_for_eta(request, in_pool=True)


def test_request_whose_eta_fired_into_the_pool_no_longer_waits(app: Celery, receive: Any) -> None:
    request, host = receive(app.tasks["compat.add"].s(1, 2), eta=datetime.now(timezone.utc) - timedelta(seconds=1))
    [(_, fun, args)] = host.timer.calls
    # The timer fires: Celery's own apply_eta_task reserves the request and hands it to the pool.
    Consumer.apply_eta_task(host, *args)
    assert host.handed_on == [request]
    assert not waits_for_eta(request, in_pool=True)


def test_request_context_is_cached_in_the_instance_dict(app: Celery, receive: Any) -> None:
    request, _ = receive(app.tasks["compat.add"].s(1, 2))
    assert cached_context(request) is None
    context = request._context
    assert "_context" in vars(request)
    assert cached_context(request) is context
    assert request._context is context
    assert context.id == request.id


def test_request_task_revoked_is_sent_with_the_cached_context(app: Celery, receive: Any) -> None:
    request, _ = receive(app.tasks["compat.add"].s(1, 2))
    sent: list[Any] = []

    def on_revoked(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        sent.append(request)

    signals.task_revoked.connect(on_revoked, weak=False)
    worker_state.revoked.add(request.id)
    try:
        assert request.revoked() is True
    finally:
        worker_state.revoked.discard(request.id)
        signals.task_revoked.disconnect(on_revoked)
    assert len(sent) == 1
    assert sent[0] is cached_context(request)
    assert sent[0] is not None


def test_request_execute_using_pool_passes_its_bound_on_success_and_on_failure(app: Celery, receive: Any) -> None:
    request, host = receive(app.tasks["compat.add"].s(1, 2))
    request.execute_using_pool(host.pool)
    [applied] = host.pool.applied
    assert applied["callback"] == request.on_success
    assert applied["error_callback"] == request.on_failure
    assert request_of_callback(applied["callback"]) is request
    assert request_of_callback(applied["error_callback"]) is request
    assert request_of_callback(lambda *a: None) is None


@pytest.mark.parametrize("settle", ["acknowledge", "reject"])
def test_request_skip_ack_makes_its_late_ack_and_reject_send_nothing(app: Celery, receive: Any, settle: str) -> None:
    request, _ = receive(app.tasks["compat.add"].s(1, 2))
    assert not was_acknowledged(request)
    skip_ack(request)
    assert was_acknowledged(request)
    getattr(request, settle)()
    # The message was never acked or rejected through the request: it is still the broker's.
    assert not request.message.acknowledged


def test_request_acknowledge_marks_it_acknowledged(app: Celery, receive: Any) -> None:
    request, _ = receive(app.tasks["compat.add"].s(1, 2))
    request.acknowledge()
    assert was_acknowledged(request) and request.message.acknowledged
