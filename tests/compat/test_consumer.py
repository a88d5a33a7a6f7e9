"""compat.consumer: where ``-P durable`` plugs into Celery's worker consumer, on a real Celery ``Consumer``."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, bootsteps
from celery.exceptions import WorkerShutdown
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from celery.worker.consumer.consumer import Evloop
from celery.worker.loops import asynloop
from kombu.asynchronous import Hub

from celery_durable.compat.consumer import ClaimingTaskConsumer, ConsumerHooks, claiming_loop, consumer_blueprint
from tests.compat.conftest import TaskMessage

#: claiming_loop's parameters: what Celery's Evloop step passes as ``c.loop(*c.loop_args())``.
LOOP_PARAMETERS = ["obj", "connection", "consumer", "blueprint", "hub", "qos", "heartbeat", "clock", "hbrate"]


class RecordingTimer:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any, tuple[Any, ...]]] = []

    def call_at(self, eta: Any, fun: Any, args: tuple[Any, ...] = (), kwargs: Any = None, priority: int = 0) -> Any:
        self.calls.append((eta, fun, args))
        return SimpleNamespace(eta=eta)


class RecordingQoS:
    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self.changes: list[int] = []

    def increment_eventually(self, n: int = 1) -> None:
        self.changes.append(n)

    def decrement_eventually(self, n: int = 1) -> None:
        self.changes.append(-n)

    def set(self, value: int) -> None:
        raise AssertionError("the prefetch count must not change")


class HooksConsumer(ConsumerHooks):
    """Celery's consumer with compat's hooks; ``when_due`` records instead of admitting."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.due: list[tuple[Any, Any]] = []

    def when_due(self, request: Any, go: Any) -> None:
        self.due.append((request, go))


def make_consumer(app: Celery, cls: type[Any] = HooksConsumer, hub: Any = None, **kwargs: Any) -> Any:
    """A real Celery consumer, not started: its collaborators (pool, timer, controller) recorded."""
    handed_on: list[Any] = []
    consumer = cls(
        handed_on.append,
        app=app,
        hub=hub,
        timer=RecordingTimer(),
        controller=SimpleNamespace(use_eventloop=hub is not None, state=SimpleNamespace(revoked=set())),
        pool=SimpleNamespace(is_green=False, apply_async=lambda *a, **kw: None),
        **kwargs,
    )
    consumer.handed_on = handed_on
    consumer.qos = RecordingQoS()
    return consumer


@pytest.fixture
def requests_made() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for request in made:
        worker_state.task_ready(request)


def test_consumer_keeps_a_loop_set_on_its_class(app: Celery) -> None:
    class Looping(ConsumerHooks):
        loop = staticmethod(claiming_loop)

    assert make_consumer(app, Looping, hub=SimpleNamespace()).loop is claiming_loop
    assert make_consumer(app, Looping).loop is claiming_loop


def test_consumer_loop_args_are_the_nine_values_claiming_loop_takes_in_order(app: Celery) -> None:
    got: list[tuple[Any, ...]] = []

    class Recording(ConsumerHooks):
        loop = staticmethod(lambda *args: got.append(args))

    hub = SimpleNamespace(name="hub")
    c = make_consumer(app, Recording, hub=hub, amqheartbeat=7)
    c.connection, c.task_consumer = SimpleNamespace(name="connection"), SimpleNamespace(name="task consumer")
    # Celery's event loop step starts the loop as c.loop(*c.loop_args()).
    Evloop(c).start(c)

    [args] = got
    assert len(args) == len(LOOP_PARAMETERS) == len(c.loop_args())
    passed = dict(zip(LOOP_PARAMETERS, args))
    assert passed["obj"] is c
    assert passed["connection"] is c.connection
    assert passed["consumer"] is c.task_consumer
    assert passed["blueprint"] is c.blueprint
    assert passed["hub"] is hub
    assert passed["qos"] is c.qos
    assert passed["heartbeat"] == 7
    assert passed["clock"] is app.clock
    assert passed["hbrate"] == app.conf.broker_heartbeat_checkrate


def test_asynloop_takes_the_parameters_claiming_loop_passes() -> None:
    for loop in (asynloop, claiming_loop):
        parameters = inspect.signature(loop).parameters
        assert list(parameters) == LOOP_PARAMETERS, loop
        assert parameters["hbrate"].default == 2.0


class _Stopped(Exception):
    pass


class FakeClaimer:
    def __init__(self) -> None:
        self.handler: Any = None
        self.handler_at_start: Any = None
        self.started = self.stopped = 0

    def start(self) -> None:
        self.handler_at_start = self.handler
        self.started += 1

    def stop(self) -> None:
        self.stopped += 1


class LoopHost:
    """What ``asynloop`` reads off the consumer before its loop; ``on_ready`` ends the run there."""

    event_dispatcher = None
    timer_entries_before_start = None

    def __init__(self) -> None:
        self.claimer = FakeClaimer()
        self.controller = SimpleNamespace(register_with_event_loop=lambda hub: None)
        self.settled: list[Any] = []
        self.handled: list[Any] = []
        self.asked: list[tuple[Any, Any]] = []

    def new_claimer(self, connection: Any, hub: Any) -> FakeClaimer:
        self.asked.append((connection, hub))
        return self.claimer

    def settle_dropped(self, message: Any) -> None:
        self.settled.append(message)

    def create_task_handler(self) -> Any:
        return self.handled.append

    def register_with_event_loop(self, hub: Any) -> None:
        pass

    def on_ready(self) -> None:
        raise _Stopped


class NoHeartbeatConnection:
    connection_errors = ()
    supports_heartbeats = False

    def get_heartbeat_interval(self) -> int:
        return 0


def test_asynloop_sets_on_message_then_calls_consume_on_claiming_task_consumer() -> None:
    host, connection, hub = LoopHost(), NoHeartbeatConnection(), Hub()
    try:
        with pytest.raises(_Stopped):
            claiming_loop(host, connection, SimpleNamespace(), SimpleNamespace(state=None), hub,
                          SimpleNamespace(update=lambda: None), 0, None, 2.0)
    finally:
        hub.close()
    claimer = host.claimer
    assert host.asked == [(connection, hub)]
    assert claimer.started == 1 and claimer.stopped == 1
    assert claimer.handler_at_start is claimer.handler is not None, "on_message must be set before consume()"
    # The handler asynloop set is Celery's task handler, then the settle.
    message = object()
    claimer.handler(message)
    assert host.handled == [message] and host.settled == [message]


def test_claiming_task_consumer_forwards_on_message_unwrapped_without_settle() -> None:
    claimer = FakeClaimer()
    stand_in = ClaimingTaskConsumer(claimer)
    stand_in.on_message = handler = lambda message: None
    assert claimer.handler is handler and stand_in.on_message is handler
    stand_in.consume()
    assert claimer.started == 1


def test_consumer_perform_pending_operations_and_on_ready_serve_the_loop_without_a_hub(
        app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_state, "should_stop", None)
    monkeypatch.setattr(worker_state, "should_terminate", None)

    class Polling(ConsumerHooks):
        loop = staticmethod(claiming_loop)
        turns = 0

        def new_claimer(self, connection: Any, hub: Any) -> FakeClaimer:
            return self.claimer

        def settle_dropped(self, message: Any) -> None:
            pass

        def run_scheduled(self) -> None:
            self.turns += 1

        def idle_poll_interval(self) -> float:
            return 0.01

    class IdleConnection:
        connection_errors = ()
        waits: list[float] = []

        def drain_events(self, timeout: float) -> None:
            self.waits.append(timeout)
            # Asked to stop during the idle wait, as Celery's warm shutdown handler does.
            monkeypatch.setattr(worker_state, "should_stop", 0)
            raise TimeoutError

    ready: list[Any] = []
    c = make_consumer(app, Polling, init_callback=ready.append)
    c.claimer = FakeClaimer()
    c.connection = IdleConnection()
    ran: list[str] = []
    c.call_soon(ran.append, "pending")  # without a hub, kept for perform_pending_operations
    c.blueprint.state = bootsteps.RUN

    with pytest.raises(WorkerShutdown):
        c.loop(*c.loop_args())
    assert ready == [c], "Consumer.on_ready calls the worker's init callback once"
    assert ran == ["pending"]
    assert c.turns == 1 and c.connection.waits == [0.01]
    assert c.claimer.started == 1 and c.claimer.stopped == 1
    assert callable(c.claimer.handler_at_start)


def test_consumer_limit_post_eta_is_what_the_strategy_schedules_for_a_rate_limited_eta(
        app: Celery, task_message: TaskMessage, requests_made: list[Any]) -> None:
    limited = app.tasks["compat.limited"]
    c = make_consumer(app)
    message = task_message(limited.s(1), countdown=60)
    limited.start_strategy(app, c)(message, None, message.ack_log_error, message.reject_log_error, [])

    [(_, fun, args)] = c.timer.calls
    request, bucket, tokens = args
    requests_made.append(request)
    assert fun == c._limit_post_eta and bucket is c.task_buckets["compat.limited"] and tokens == 1
    # The ETA passes: compat's override holds it for when_due instead of Celery's own.
    fun(*args)
    [(due, go)] = c.due
    assert due is request and c.handed_on == []
    go()
    # Celery's _limit_post_eta: the bucket has a token, so the request goes to the pool.
    assert c.handed_on == [request]
    assert c.qos.changes == [1, -1]


def test_consumer_apply_eta_task_is_what_the_strategy_schedules_for_an_eta(
        app: Celery, task_message: TaskMessage, requests_made: list[Any]) -> None:
    add = app.tasks["compat.add"]
    c = make_consumer(app)
    message = task_message(add.s(1, 2), countdown=60)
    add.start_strategy(app, c)(message, None, message.ack_log_error, message.reject_log_error, [])

    [(_, fun, args)] = c.timer.calls
    [request] = args
    requests_made.append(request)
    assert fun == c.apply_eta_task
    Consumer.apply_eta_task(c, request)
    assert c.handed_on == [request]
    assert worker_state.requests.get(request.id) is request


def test_consumer_limit_post_eta_takes_request_bucket_tokens() -> None:
    host = inspect.signature(Consumer._limit_post_eta)
    ours = inspect.signature(ConsumerHooks._limit_post_eta)
    assert list(host.parameters) == list(ours.parameters) == ["self", "request", "bucket", "tokens"]


def test_consumer_restore_prefetch_count_after_connection_restart_takes_a_promise_and_args() -> None:
    for method in (Consumer._restore_prefetch_count_after_connection_restart,
                   ConsumerHooks._restore_prefetch_count_after_connection_restart):
        parameters = list(inspect.signature(method).parameters.values())
        assert [p.name for p in parameters] == ["self", "p", "args"]
        assert parameters[2].kind is inspect.Parameter.VAR_POSITIONAL


def test_consumer_restore_prefetch_count_after_connection_restart_is_a_no_op_once_restored(app: Celery) -> None:
    c = make_consumer(app, Consumer)
    c._maximum_prefetch_restored = True
    Consumer._restore_prefetch_count_after_connection_restart(c, None)  # RecordingQoS.set would raise

    hooks = make_consumer(app)
    hooks._maximum_prefetch_restored = False
    hooks._restore_prefetch_count_after_connection_restart(None, "ack result")
    assert hooks._maximum_prefetch_restored is True


def _step_names(consumer: Any) -> list[str]:
    return [step.name for step in consumer.blueprint.order]


def test_consumer_blueprint_builds_celerys_steps_and_then_the_extra_ones(app: Celery) -> None:
    class Extended(Consumer):  # type: ignore[misc]
        Blueprint = consumer_blueprint(f"{__name__}:MarkerStep")

    stock, extended = _step_names(make_consumer(app, Consumer)), _step_names(make_consumer(app, Extended))
    assert f"{__name__}.MarkerStep" in extended
    # The blueprint orders steps by their requirements only: independent ones come in any order.
    assert sorted(name for name in extended if name != f"{__name__}.MarkerStep") == sorted(stock)
    assert extended.index(f"{__name__}.MarkerStep") > extended.index("celery.worker.consumer.tasks.Tasks")
    assert Extended.Blueprint.name == Consumer.Blueprint.name


def test_consumer_blueprint_adds_a_step_only_to_the_consumer_class_it_is_set_on(app: Celery) -> None:
    class Extended(Consumer):  # type: ignore[misc]
        Blueprint = consumer_blueprint(f"{__name__}:MarkerStep")

    make_consumer(app, Extended)
    assert f"{__name__}.MarkerStep" not in _step_names(make_consumer(app, Consumer))


class MarkerStep(bootsteps.StartStopStep):
    """A consumer step the tests can find (it requires Celery's Tasks step, as DurableStats does)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
