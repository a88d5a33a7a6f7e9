"""WorkerRuntime on kombu's in-memory transport: each count is given back exactly once, passes claim in turn."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from time import monotonic
from typing import Any
from uuid import uuid4

import pytest
from kombu import Connection, Queue

from celery_durable.clock import Clock
from celery_durable.config import DurableConfig
from celery_durable.testing.clock import FakeClock
from celery_durable.worker.claimer import Claimer
from celery_durable.worker.runtime import WorkerRuntime


class Context:
    """The task Context that Celery's ``task_revoked`` signal sends, not the worker request."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id


class Request:
    """What Celery's strategy makes of a message: only the attributes the runtime reads."""

    def __init__(self, message: Any, *, eta: bool = False) -> None:
        self.message = message
        self.id: str = message.headers["id"]
        self.acknowledged = False
        # Celery 5.7 sets this once it has put the request on its ETA timer; 5.5/5.6 go by ``eta``.
        self._eta_timer_entry = object() if eta else None
        self.eta = "2030-01-01T00:00:00+00:00" if eta else None
        # Celery's Request caches its Context in __dict__; the revoke signal sends that very object.
        self._context = Context(self.id)


class Strategy:
    """Stands in for Celery's task handler, wrapped as ``DurableConsumer`` wraps it.

    The body's ``kind`` says what Celery's strategy would do with the message:
    ``run`` makes a request (``task_received`` tells the runtime), ``eta`` makes
    one that waits on the ETA timer, ``drop`` makes none (revoked, expired,
    unknown task), ``settle`` makes one and then rejects the message itself (an
    ETA that overflows the time zone).
    """

    def __init__(self, runtime: WorkerRuntime, timeline: list[tuple[str, str]]) -> None:
        self._runtime = runtime
        self._timeline = timeline
        self.requests: dict[str, Request] = {}
        #: The queue each admitted message came from, in order.
        self.queues: list[str] = []

    def __call__(self, message: Any) -> None:
        try:
            self._timeline.append(("claimed", message.headers["id"]))
            self.queues.append(message.delivery_info["routing_key"])
            kind = message.decode()["kind"]
            if kind == "drop":
                return
            request = Request(message, eta=kind == "eta")
            self.requests[request.id] = request
            self._runtime.request_made(request)
            if kind == "settle":
                message.reject(requeue=False)
                request.acknowledged = True
        finally:
            # What DurableConsumer's stand-in does once Celery's strategy has returned.
            self._runtime.settle_dropped(message)


class Worker:
    """A runtime and its claimer on a memory connection, with the strategy stand-in as task handler.

    Kicks wait in ``scheduled`` (what Celery's ``hub.call_soon`` would run) until the test runs them.
    """

    def __init__(self, connection: Connection, queue_names: list[str], *, pool_limit: int,
                 config: DurableConfig, clock: Clock,
                 republish: Callable[[], AbstractContextManager[Connection]]) -> None:
        self.queues = [Queue(name) for name in queue_names]
        self.scheduled: list[Callable[[], None]] = []
        #: ("claimed", task id) as the strategy gets a message, ("started", task id) as a due run goes.
        self.timeline: list[tuple[str, str]] = []
        self.runtime = WorkerRuntime(config, queues=queue_names, pool_limit=pool_limit,
                                     republish_connection=republish, clock=clock)
        self.strategy = Strategy(self.runtime, self.timeline)
        self.claimer: Claimer = self.runtime.new_claimer(
            connection, queues=lambda: list(self.queues), accept=["json"], schedule=self.scheduled.append,
        )
        self.claimer.handler = self.strategy

    def run_scheduled(self) -> int:
        """Run what is queued now (what that queues waits for the next call); how many ran."""
        ready = list(self.scheduled)
        self.scheduled.clear()
        for fn in ready:
            fn()
        return len(ready)

    def claim_pass(self) -> None:
        self.runtime.kick()
        assert self.run_scheduled() == 1

    def request(self, task_id: str) -> Request:
        return self.strategy.requests[task_id]

    def idle_wait_queues(self) -> set[str]:
        # The claimer's stats are the only view of its idle wait short of a
        # delivery (which the tests also check).
        return set(self.claimer.stats().idle_waiting_on)


@contextmanager
def memory_connection() -> Iterator[Connection]:
    """What ``app.connection_for_write`` gives the drain: a connection of its own, to the same (global) broker."""
    with Connection("memory://") as connection:
        yield connection


def names(*labels: str) -> list[str]:
    """Queue names no other test uses: the memory transport's queues are process-global."""
    return [f"{label}-{uuid4().hex}" for label in labels]


def publish(connection: Connection, queue: str, kind: str = "run") -> str:
    task_id = uuid4().hex
    connection.Producer().publish(
        {"kind": kind}, routing_key=queue, declare=[Queue(queue)], headers={"id": task_id}, serializer="json",
    )
    return task_id


def waiting(connection: Connection, queue: str) -> int:
    """Messages ready on ``queue`` (not held by anyone)."""
    return Queue(queue, channel=connection.default_channel).queue_declare(passive=True).message_count


def take_all(connection: Connection, queue: str) -> list[Any]:
    bound = Queue(queue, channel=connection.default_channel)
    messages = []
    while (message := bound.get(no_ack=True)) is not None:
        messages.append(message)
    return messages


def wait_for(condition: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = monotonic() + timeout
    while not condition():
        if monotonic() > deadline:
            raise AssertionError("condition not met within the deadline")
        threading.Event().wait(0.001)


@pytest.fixture
def connection() -> Iterator[Connection]:
    with Connection("memory://") as conn:
        yield conn


@pytest.fixture
def make_worker(connection: Connection) -> Iterator[Callable[..., Worker]]:
    """Makes a started Worker (its first pass runs in ``start``, as in Celery); closes each at teardown."""
    made: list[Worker] = []

    def make(queue_names: list[str], *, pool_limit: int = 4, config: DurableConfig | None = None,
             clock: Clock | None = None,
             republish: Callable[[], AbstractContextManager[Connection]] = memory_connection) -> Worker:
        worker = Worker(connection, queue_names, pool_limit=pool_limit, config=config or DurableConfig(),
                        clock=clock or FakeClock(), republish=republish)
        made.append(worker)
        worker.claimer.start()
        return worker

    yield make
    for worker in made:
        worker.claimer.close()


# -- kicks and timers -------------------------------------------------------------------


def test_many_kicks_before_the_pass_runs_make_one_pass_and_a_kick_after_it_makes_another(make_worker):
    worker = make_worker(names("q"))
    # start() ran the first pass itself, not through the schedule.
    assert (worker.claimer.passes, worker.scheduled) == (1, [])

    for _ in range(5):
        worker.claimer.kick()
        worker.runtime.kick()
    assert len(worker.scheduled) == 1

    assert worker.run_scheduled() == 1
    assert worker.claimer.passes == 2
    assert worker.scheduled == []

    worker.runtime.kick()
    worker.runtime.kick()
    assert len(worker.scheduled) == 1


def test_kicks_from_many_threads_coalesce_into_one_scheduled_pass(make_worker):
    worker = make_worker(names("q"))
    start = threading.Barrier(8)

    def kick_often() -> None:
        start.wait()
        for _ in range(200):
            worker.runtime.kick()

    threads = [threading.Thread(target=kick_often) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(worker.scheduled) == 1


def test_without_a_hub_kicks_wait_for_run_scheduled_and_the_safety_timer_kicks_once_per_interval(connection):
    clock = FakeClock()
    runtime = WorkerRuntime(DurableConfig(safety_interval=1.0), queues=names("q"), pool_limit=2,
                            republish_connection=memory_connection, clock=clock)
    claimer = runtime.new_claimer(connection, queues=lambda: [], accept=["json"])
    claimer.handler = lambda message: None
    claimer.start()
    try:
        assert claimer.passes == 1
        runtime.kick()
        runtime.kick()
        assert claimer.passes == 1  # queued, not run: no hub runs it

        passes_at = {}
        for step in range(9):  # t = 0, 0.25, ..., 2.0
            clock.set(step * 0.25)
            # Two loop iterations at each instant: a timer's kick is queued by one and run by the next.
            runtime.run_scheduled()
            runtime.run_scheduled()
            passes_at[step * 0.25] = claimer.passes
    finally:
        claimer.close()

    # The two kicks made one pass; the safety timer fired at t = 0, 1.0 and 2.0 and nowhere between.
    assert passes_at == {0.0: 3, 0.25: 3, 0.5: 3, 0.75: 3, 1.0: 4, 1.25: 4, 1.5: 4, 1.75: 4, 2.0: 5}


# -- counting: every count taken is given back exactly once ------------------------------


def test_a_run_the_pool_finished_is_given_back_once_and_kicks_a_pass(connection, make_worker):
    [q] = names("q")
    task_id = publish(connection, q)
    worker = make_worker([q])
    runtime, request = worker.runtime, worker.request(task_id)
    assert runtime.in_flight() == 1
    assert runtime.held_messages() == [request.message]

    runtime.run_pooled(request)
    assert runtime.in_flight() == 1
    assert worker.scheduled == []

    runtime.run_finished(request)
    assert runtime.in_flight() == 0
    assert runtime.held_messages() == []
    assert len(worker.scheduled) == 1  # the freed slot is offered at once

    worker.run_scheduled()
    runtime.run_finished(request)
    assert runtime.in_flight() == 0
    assert runtime.stats()["held_by_queue"] == {q: 0}
    assert worker.scheduled == []  # nothing was given back, so nothing to claim


def test_a_message_the_strategy_made_no_request_for_is_given_back_at_once(connection, make_worker):
    [q] = names("q")
    dropped = publish(connection, q, "drop")
    worker = make_worker([q])

    assert worker.timeline == [("claimed", dropped)]
    assert worker.strategy.requests == {}
    assert worker.runtime.in_flight() == 0
    assert worker.runtime.held_messages() == []
    assert worker.runtime.stats()["held_by_queue"] == {q: 0}


@pytest.mark.parametrize("signal_context", ["cached", "same_id"],
                         ids=["the-request's-own-context", "a-context-with-its-id"])
def test_a_revoke_before_the_pool_gives_the_run_back_and_one_after_leaves_it_to_the_pool(
        connection, make_worker, signal_context):
    [q] = names("q")
    early, pooled = publish(connection, q), publish(connection, q)
    worker = make_worker([q])
    runtime = worker.runtime

    def context_of(request: Request) -> Any:
        # Celery sends the request's cached Context; one that stopped caching it would send an equal one.
        return request._context if signal_context == "cached" else Context(request.id)

    assert runtime.in_flight() == 2
    runtime.run_pooled(worker.request(pooled))

    runtime.request_revoked(context_of(worker.request(pooled)))
    assert runtime.in_flight() == 2  # the pool's callback gives it back
    assert worker.scheduled == []

    runtime.request_revoked(context_of(worker.request(early)))
    assert runtime.in_flight() == 1
    assert len(worker.scheduled) == 1
    runtime.request_revoked(context_of(worker.request(early)))
    assert runtime.in_flight() == 1

    runtime.run_finished(worker.request(pooled))
    assert runtime.in_flight() == 0


def test_a_request_the_strategy_settled_itself_is_given_back_as_the_strategy_returns(connection, make_worker):
    [q] = names("q")
    settled, running = publish(connection, q, "settle"), publish(connection, q)
    worker = make_worker([q])
    runtime = worker.runtime

    assert set(worker.strategy.requests) == {settled, running}
    assert runtime.held_messages() == [worker.request(running).message]
    assert runtime.in_flight() == 1
    assert waiting(connection, q) == 0  # rejected without requeue by the strategy, not by the runtime

    # Neither a request still waiting (not acknowledged) nor one the pool has is the strategy's to settle.
    runtime.settle_dropped(worker.request(running).message)
    assert runtime.in_flight() == 1
    runtime.run_pooled(worker.request(running))
    worker.request(running).acknowledged = True  # acked as the pool started it (acks_late off)
    runtime.settle_dropped(worker.request(running).message)
    assert runtime.in_flight() == 1

    runtime.run_finished(worker.request(running))
    assert runtime.in_flight() == 0


def test_a_lost_connection_gives_back_runs_outside_the_pool_and_keeps_pool_runs_counted_but_unacked(
        connection, make_worker):
    [q] = names("q")
    eta, pooled, rate_limited = publish(connection, q, "eta"), publish(connection, q), publish(connection, q)
    worker = make_worker([q], pool_limit=2)
    worker.claim_pass()
    runtime = worker.runtime
    assert (runtime.in_flight(), runtime.stats()["scheduled"]) == (2, 1)
    runtime.run_pooled(worker.request(pooled))
    started: list[str] = []
    runtime.when_admitted(worker.request(eta), lambda: started.append(eta))  # due, but the worker is full
    assert started == []

    runtime.connection_lost()

    assert runtime.held_messages() == [worker.request(pooled).message]
    assert (runtime.in_flight(), runtime.stats()["scheduled"]) == (1, 0)
    # Its late ack would go to a dead channel: marked settled so Celery never sends it.
    assert worker.request(pooled).acknowledged is True
    assert worker.request(rate_limited).acknowledged is False

    runtime.run_finished(worker.request(rate_limited))  # Celery's late word on a dropped run changes nothing
    assert runtime.in_flight() == 1
    assert worker.scheduled == []

    runtime.run_finished(worker.request(pooled))
    assert runtime.in_flight() == 0
    worker.run_scheduled()
    assert started == []  # the due run was Celery's to drop with the connection


# -- capacity and turns ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_in_flight", "pool_limit", "slots"),
    [(2, 4, 8), (None, 2, 8), (None, 4, 2)],
    ids=["max-in-flight", "pool-size", "queue-slots"],
)
def test_one_pass_claims_no_more_than_the_capacity(connection, make_worker, max_in_flight, pool_limit, slots):
    [q] = names("q")
    for _ in range(5):
        publish(connection, q)
    worker = make_worker([q], pool_limit=pool_limit,
                         config=DurableConfig(max_in_flight=max_in_flight, default_queue_slots=slots))

    assert worker.runtime.capacity() == 2
    assert worker.runtime.in_flight() == 2
    assert waiting(connection, q) == 3
    assert worker.claimer.passes == 1


def test_freed_slots_go_to_the_queues_in_turn_whichever_run_finished(connection, make_worker):
    a, b, c = names("a", "b", "c")
    for queue in (a, b, c):
        for _ in range(3):
            publish(connection, queue)
    worker = make_worker([a, b, c], pool_limit=3)
    runtime = worker.runtime
    assert worker.strategy.queues == [a, b, c]
    assert worker.claimer.cursor == c
    first = {request.message.delivery_info["routing_key"]: request for request in worker.strategy.requests.values()}

    # Runs finish on b, then c, then a; the slots go to a, b, c: the turn, not the queue that freed it.
    for finished, expected in [(b, a), (c, b), (a, c)]:
        runtime.run_finished(first[finished])
        worker.run_scheduled()
        assert worker.strategy.queues[-1] == expected
        assert worker.claimer.cursor == expected
    assert runtime.in_flight() == 3
    assert [waiting(connection, queue) for queue in (a, b, c)] == [1, 1, 1]


# -- the idle wait ----------------------------------------------------------------------------


def test_an_idle_pass_waits_on_every_queue_and_a_delivery_is_admitted_and_kicks_a_pass(connection, make_worker):
    a, b = names("a", "b")
    worker = make_worker([a, b], pool_limit=4)
    assert worker.runtime.in_flight() == 0
    assert worker.idle_wait_queues() == {a, b}

    first, second = publish(connection, b), publish(connection, b)
    connection.drain_events(timeout=1)

    assert [task_id for _, task_id in worker.timeline] == [first]
    assert worker.runtime.in_flight() == 1
    assert worker.claimer.cursor == b
    assert worker.idle_wait_queues() == set()  # cancelled once it delivered
    assert len(worker.scheduled) == 1

    # The kicked pass fills the room with planned asks, then waits again.
    worker.run_scheduled()
    assert [task_id for _, task_id in worker.timeline] == [first, second]
    assert worker.runtime.in_flight() == 2
    assert worker.idle_wait_queues() == {a, b}


def test_a_full_worker_arms_no_idle_wait(connection, make_worker):
    [q] = names("q")
    publish(connection, q)
    worker = make_worker([q], pool_limit=1)
    assert worker.runtime.in_flight() == 1
    assert worker.idle_wait_queues() == set()

    publish(connection, q)
    with pytest.raises(TimeoutError):
        connection.drain_events(timeout=0.01)
    assert waiting(connection, q) == 1
    assert worker.runtime.in_flight() == 1


# -- ETA runs -----------------------------------------------------------------------------------


def test_a_claimed_eta_run_is_counted_but_holds_no_slot(connection, make_worker):
    [q] = names("q")
    eta = publish(connection, q, "eta")
    worker = make_worker([q], pool_limit=1)
    runtime = worker.runtime

    assert (runtime.in_flight(), runtime.stats()["scheduled"]) == (0, 1)
    assert runtime.held_messages() == [worker.request(eta).message]
    assert worker.idle_wait_queues() == {q}  # its slot is free for other work

    started: list[str] = []
    runtime.when_admitted(worker.request(eta), lambda: started.append(eta))  # room: it goes at once
    assert started == [eta]
    assert (runtime.in_flight(), runtime.stats()["scheduled"]) == (1, 0)


def test_a_run_due_while_full_takes_the_freed_slot_before_any_new_claim(connection, make_worker):
    [q] = names("q")
    eta = publish(connection, q, "eta")
    worker = make_worker([q], pool_limit=1)
    running = publish(connection, q)
    worker.claim_pass()
    runtime = worker.runtime
    assert (runtime.in_flight(), runtime.stats()["scheduled"]) == (1, 1)

    fresh = publish(connection, q)
    runtime.when_admitted(worker.request(eta), lambda: worker.timeline.append(("started", eta)))
    assert ("started", eta) not in worker.timeline  # full: it waits for a slot

    runtime.run_pooled(worker.request(running))
    runtime.run_finished(worker.request(running))
    worker.run_scheduled()

    assert worker.timeline == [("claimed", eta), ("claimed", running), ("started", eta)]
    assert waiting(connection, q) == 1  # the new message was not fetched: the slot was the due run's
    assert (runtime.in_flight(), runtime.stats()["scheduled"]) == (1, 0)

    runtime.run_pooled(worker.request(eta))
    runtime.run_finished(worker.request(eta))
    worker.run_scheduled()
    assert worker.timeline[-1] == ("claimed", fresh)


def test_a_run_falling_due_waits_behind_runs_that_fell_due_earlier(connection, make_worker):
    [q] = names("q")
    first = publish(connection, q, "eta")
    worker = make_worker([q], pool_limit=1)
    second = publish(connection, q, "eta")
    worker.claim_pass()
    running = publish(connection, q)
    worker.claim_pass()
    runtime = worker.runtime
    assert (runtime.in_flight(), runtime.stats()["scheduled"]) == (1, 2)

    started: list[str] = []
    runtime.when_admitted(worker.request(first), lambda: started.append(first))
    runtime.run_finished(worker.request(running))  # its kick is queued, not run yet
    runtime.when_admitted(worker.request(second), lambda: started.append(second))
    worker.run_scheduled()

    assert started == [first]


# -- the drain --------------------------------------------------------------------------------


def test_the_drain_hands_every_held_run_back_to_the_broker_at_the_deadline(connection, make_worker):
    [q] = names("q")
    late_ack, early_ack, eta = publish(connection, q), publish(connection, q), publish(connection, q, "eta")
    opened: list[Connection] = []

    @contextmanager
    def republish() -> Iterator[Connection]:
        with memory_connection() as conn:
            opened.append(conn)
            yield conn

    worker = make_worker([q], config=DurableConfig(drain_timeout=0), republish=republish)
    runtime = worker.runtime
    runtime.run_pooled(worker.request(late_ack))
    runtime.run_pooled(worker.request(early_ack))
    worker.request(early_ack).message.ack()  # acks_late off: the broker no longer has it
    bodies = {task_id: worker.request(task_id).message.body for task_id in (late_ack, early_ack, eta)}
    assert waiting(connection, q) == 0

    runtime.drain.start()
    runtime.drain.join()

    assert all(runtime.is_handed_back(worker.request(task_id)) for task_id in (late_ack, early_ack, eta))
    assert {run.message.headers["id"] for run in runtime.drain.handed_back} == {late_ack, early_ack, eta}
    assert len(opened) == 1  # only the acked one needed a copy
    back = take_all(connection, q)
    assert sorted(message.headers["id"] for message in back) == sorted([late_ack, early_ack, eta])
    assert {message.headers["id"]: message.body for message in back} == bodies
    # The pool's callbacks for the killed runs give the counts back later.
    assert runtime.in_flight() == 2


def test_the_drain_hands_back_only_what_is_still_held_when_its_clock_passes_the_deadline(
        connection, make_worker):
    [q] = names("q")
    finishes, overruns = publish(connection, q), publish(connection, q)
    clock = FakeClock()
    worker = make_worker([q], config=DurableConfig(drain_timeout=30), clock=clock)
    runtime = worker.runtime
    runtime.run_pooled(worker.request(finishes))
    runtime.run_pooled(worker.request(overruns))

    reads_before = clock.reads
    runtime.drain.start()
    wait_for(lambda: clock.reads > reads_before)  # the drain has read its deadline off the clock
    runtime.run_finished(worker.request(finishes))
    clock.set(29.0)
    assert runtime.drain.handed_back == []
    clock.set(30.0)
    runtime.drain.join()

    assert [run.message for run in runtime.drain.handed_back] == [worker.request(overruns).message]
    assert not runtime.is_handed_back(worker.request(finishes))
    assert [message.headers["id"] for message in take_all(connection, q)] == [overruns]


# -- stats and queues ------------------------------------------------------------------------------


def test_stats_report_the_claim_state(connection, make_worker):
    a, b = names("a", "b")
    publish(connection, a)
    publish(connection, a)
    publish(connection, b)
    publish(connection, b, "eta")
    worker = make_worker([a, b], pool_limit=4,
                         config=DurableConfig(max_in_flight=3, queue_slots={a: 1}))

    assert worker.runtime.stats() == {
        "in_flight": 2,
        "scheduled": 1,
        "max_in_flight": 3,
        "capacity": 3,
        "pool_size": 4,
        "held_by_queue": {a: 1, b: 1},
        "queue_slots": {a: 1, b: 8},
        "claim_passes": 1,
        "claim_round_trips": 3,  # one basic_get per message on the memory transport
        "claims_handed_back": 0,
        "claimed_by_passes": 3,
        "claimed_by_idle_wait": 0,
        "claimed_by_push": 0,  # the memory transport has no push consumer
        "claim_pushing": None,
        "idle_wakes": 0,
        "idle_waiting_on": [b],  # a is at its slot; room is left for b
        "claimed_by_watch": 0,  # the memory transport has no queue watch
        "watch_given_back": 0,
        "watch_credits": 0,
        "watching": [],
        "leases": {},  # no task declares a fleet limit: no gate
        "limits_waited": 0,
        "limits_dropped": 0,
        "metrics_port": None,  # this process serves no metrics
    }


def test_an_added_queue_gets_its_slots_and_is_claimed_from_at_once(connection, make_worker):
    a, added = names("a", "added")
    worker = make_worker([a], config=DurableConfig(queue_slots={a: 2}))
    task_id = publish(connection, added)
    # As Celery's consume_from gains the queue before the consumer's add_task_queue tells the runtime.
    worker.queues.append(Queue(added))

    worker.runtime.add_queue(added)

    assert worker.runtime.stats()["queue_slots"] == {a: 2, added: 8}
    assert len(worker.scheduled) == 1
    worker.run_scheduled()
    assert worker.timeline == [("claimed", task_id)]
    assert worker.runtime.stats()["held_by_queue"] == {a: 0, added: 1}


def test_an_added_queue_raises_a_capacity_its_slots_bounded(connection, make_worker):
    a, added = names("a", "added")
    publish(connection, a)
    worker = make_worker([a], pool_limit=4, config=DurableConfig(default_queue_slots=1))
    assert worker.runtime.capacity() == 1
    task_id = publish(connection, added)
    worker.queues.append(Queue(added))

    worker.runtime.add_queue(added)
    worker.run_scheduled()

    assert worker.runtime.capacity() == 2
    assert worker.timeline[-1] == ("claimed", task_id)
    assert worker.runtime.in_flight() == 2


def test_a_pool_shrunk_below_the_runs_held_claims_nothing_until_it_grows_again(connection, make_worker):
    [a] = names("a")
    ids = [publish(connection, a) for _ in range(4)]
    worker = make_worker([a], pool_limit=3)
    assert worker.runtime.in_flight() == 3

    worker.runtime.pool_resized(2)   # celery control pool_shrink: one process went
    worker.run_scheduled()
    assert (worker.runtime.capacity(), worker.runtime.stats()["pool_size"]) == (2, 2)
    worker.runtime.run_finished(worker.request(ids[0]))
    worker.run_scheduled()
    # Two held is the new capacity: the fourth stays in the broker, not behind them.
    assert worker.runtime.in_flight() == 2
    assert [task for event, task in worker.timeline if event == "claimed"] == ids[:3]

    worker.runtime.pool_resized(4)   # pool_grow
    worker.run_scheduled()
    assert worker.timeline[-1] == ("claimed", ids[3])
    assert (worker.runtime.capacity(), worker.runtime.in_flight()) == (4, 3)


def test_a_pool_shrunk_to_no_process_claims_nothing(connection, make_worker):
    [a] = names("a")
    worker = make_worker([a], pool_limit=2)
    worker.runtime.pool_resized(0)
    publish(connection, a)
    worker.claim_pass()
    assert worker.runtime.capacity() == 0
    assert worker.timeline == []


def test_a_cancelled_queue_leaves_the_idle_wait_before_anything_else_runs(connection, make_worker):
    a, b = names("a", "b")
    worker = make_worker([a, b])
    assert worker.idle_wait_queues() == {a, b}
    # As Celery's consume_from loses the queue before the consumer's cancel_task_queue tells the runtime.
    worker.queues[:] = [q for q in worker.queues if q.name != a]

    worker.runtime.queue_cancelled(a)
    # The wait on a is gone at once, not at the next pass: a message sent after the reply stays put.
    assert worker.idle_wait_queues() == set()
    publish(connection, a)
    worker.run_scheduled()
    assert worker.idle_wait_queues() == {b}
    assert worker.timeline == []


def test_the_drain_hands_back_runs_the_pool_never_got_as_soon_as_the_pool_has_none_left(connection, make_worker):
    # Before: a run holding a slot but never handed to the pool (waiting for a rate-limit token, or
    # due and waiting for a slot) held every warm shutdown to the deadline (30 s by default): the
    # consumer and Celery's timers stop before the pool, so it could never start.
    [q] = names("q")
    eta = publish(connection, q, "eta")
    clock = FakeClock()
    worker = make_worker([q], pool_limit=2, config=DurableConfig(drain_timeout=30), clock=clock)
    running, waiting_for_token = publish(connection, q), publish(connection, q)
    worker.claim_pass()
    runtime = worker.runtime
    runtime.run_pooled(worker.request(running))
    assert (runtime.in_flight(), runtime.stats()["scheduled"]) == (2, 1)
    started: list[str] = []

    runtime.drain.start()
    assert runtime.drain.handed_back == []  # the pooled run may still finish: the drain waits for it
    runtime.run_finished(worker.request(running))
    wait_for(lambda: len(runtime.drain.handed_back) == 2)
    runtime.drain.join()

    assert clock.monotonic() == 0.0  # long before the deadline
    assert sorted(run.message.headers["id"] for run in runtime.drain.handed_back) == sorted([eta, waiting_for_token])
    assert sorted(message.headers["id"] for message in take_all(connection, q)) == sorted([eta, waiting_for_token])
    # A late ETA callback for a handed-back run does not start it beside its requeued copy.
    runtime.when_admitted(worker.request(eta), lambda: started.append(eta))
    runtime.admit_due()
    assert started == []
