"""The PostgreSQL broker's claim: dead at claim for rows whose holders keep dying; a countdown as visible_at."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

import celery_durable
from celery_durable.broker import dead_letters, register, rows
from celery_durable.broker.backend import PgRows
from celery_durable.headers import PARKED_REASON_HEADER
from celery_durable.metrics import jobs as metrics
from celery_durable.store.engine import ensure_schema
from celery_durable.tasks import runs as durable_runs
from tests.stores import fresh_database, fresh_store

DYING_TTL = 0.3


@pytest.fixture
def db_url(tmp_path: Path) -> Iterator[str]:
    with fresh_store("postgresql", tmp_path) as url:
        ensure_schema(url)
        yield url


def _app(db_url: str) -> Celery:
    register()
    app = Celery(f"dead{uuid.uuid4().hex[:6]}", broker=f"durable+{db_url}", set_as_current=False)
    celery_durable.install(app)
    app.conf.update(durable_database_url=db_url, task_default_queue="q")
    return app


def _die_holding(db_url: str, times: int) -> None:
    """``times`` holders each take the row and die (their leases lapse): what SIGKILLed workers leave."""
    engine = ensure_schema(db_url)
    for n in range(times):
        deadline = time.monotonic() + 5
        while not rows.claim(engine, "q", 10, f"dead-{n}", DYING_TTL):
            assert time.monotonic() < deadline, "the dead holder's lease never lapsed"
            time.sleep(0.05)
    time.sleep(DYING_TTL + 0.1)


def _claimer(db_url: str, app: Celery) -> PgRows:
    return PgRows(db_url, lease_ttl=30, bury=lambda q, p, n: dead_letters.bury(app, q, p, n))


def _rows(db_url: str) -> list[Any]:
    with ensure_schema(db_url).connect() as c:
        return c.execute(sa.text("SELECT queue, payload, holder, lapses FROM durable_broker_messages")).all()


def test_a_plain_tasks_row_is_delivered_while_budget_is_left_then_parked_with_a_reason(db_url: str) -> None:
    app = _app(db_url)
    app.conf.result_backend = f"db+{db_url}"

    @app.task(name="plain", max_retries=1)
    def plain() -> None: ...

    result = plain.delay()
    _die_holding(db_url, 1)
    live = _claimer(db_url, app)
    try:
        # One holder died: the task may be run twice (max_retries=1), so this hand-out is work.
        (got,) = live.claim("q", 10)
        assert got["headers"]["id"] == result.id and got["redelivered"] is True
        live.give_back(got["properties"]["delivery_tag"])
        _die_holding(db_url, 1)  # a second holder dies: the budget of two hand-outs is spent
        before = metrics.value("q", "dead_lettered")
        assert live.claim("q", 10) == []
    finally:
        live.close()
    ((queue, payload, holder, lapses),) = _rows(db_url)
    assert (queue, holder, lapses) == ("q.durable.parked", None, 2)
    message = json.loads(payload)
    assert message["headers"]["id"] == result.id
    assert "every holder died" in message["headers"][PARKED_REASON_HEADER]
    assert metrics.value("q", "dead_lettered") == before + 1
    # As stock Celery records a task whose process died: the result is FAILURE, get() does not hang.
    assert result.state == "FAILURE" and "every holder died" in str(result.result)
    assert type(result.result).__name__ == "RunExhausted"


def test_a_durable_tasks_run_is_settled_dead_by_the_claim_and_its_row_deleted(db_url: str) -> None:
    app = _app(db_url)
    app.conf.result_backend = f"db+{db_url}"
    settled: list[Any] = []

    @app.durable_task(name="durable", max_retries=0, on_settled=settled.append)
    def durable(order: int) -> None: ...

    result = durable.delay(7)
    _die_holding(db_url, 1)
    live = _claimer(db_url, app)
    try:
        assert live.claim("q", 10) == []
    finally:
        live.close()
    assert _rows(db_url) == []
    run = durable_runs.get(result.id, app=app)
    assert run.state == "dead" and "every holder died" in (run.last_error or "")
    assert json.loads(run.args) == [7]  # requeue-able as it came
    assert [r.id for r in settled] == [result.id]
    assert result.state == "FAILURE" and "every holder died" in str(result.result)


def test_a_row_given_back_is_not_a_lapse_and_a_task_with_no_limit_is_never_buried(db_url: str) -> None:
    app = _app(db_url)

    @app.task(name="unbounded", max_retries=None)
    def unbounded() -> None: ...

    @app.task(name="bounded", max_retries=0)
    def bounded() -> None: ...

    unbounded.delay()
    _die_holding(db_url, 3)
    bounded.apply_async(queue="r")
    live = _claimer(db_url, app)
    try:
        assert [m["headers"]["task"] for m in live.claim("q", 10)] == ["unbounded"]
        for _ in range(3):  # handed back (a warm shutdown, a requeue): no holder died
            (got,) = live.claim("r", 10)
            live.give_back(got["properties"]["delivery_tag"])
        assert [m["headers"]["task"] for m in live.claim("r", 10)] == ["bounded"]
    finally:
        live.close()


def test_the_whole_pass_buries_too(db_url: str) -> None:
    app = _app(db_url)

    @app.task(name="plain-in-a-pass", max_retries=0)
    def plain() -> None: ...

    plain.delay()
    plain.apply_async(queue="other")
    _die_holding(db_url, 1)
    live = _claimer(db_url, app)
    try:
        asks = live.claim_pass(["q", "other"], [5, 5], None)
    finally:
        live.close()
    # The buried row was taken (and counts against the ask, as a parked poison row does); none is handed out
    # from q, the other queue's is.
    assert [(q, taken, len(messages)) for q, _, taken, messages in asks] == [("q", 1, 0), ("other", 1, 1)]
    assert sorted(r.queue for r in _rows(db_url)) == ["other", "q.durable.parked"]


def test_a_celery_countdown_rides_visible_at_so_no_claim_takes_it_before_its_time(db_url: str) -> None:
    app = _app(db_url)

    @app.task(name="later")
    def later() -> None: ...

    sent = time.monotonic()
    result = later.apply_async(countdown=1.5)
    live = _claimer(db_url, app)
    try:
        assert live.claim("q", 10) == []
        while not (got := live.claim("q", 10)):
            assert time.monotonic() - sent < 10, "the countdown row never came due"
            time.sleep(0.05)
        assert time.monotonic() - sent >= 1.4
        assert [m["headers"]["id"] for m in got] == [result.id]
        assert got[0]["headers"]["eta"]  # Celery's own eta still travels: the worker checks it on receipt
    finally:
        live.close()


def test_a_durable_workers_lease_keeper_renews_its_rows_with_no_thread_of_the_transports(db_url: str) -> None:
    import threading

    from celery_durable.leases.keeper import LeaseKeeper

    heartbeat = LeaseKeeper()
    live = PgRows(db_url, lease_ttl=0.6)
    live.beat_with(heartbeat)
    engine = ensure_schema(db_url)
    try:
        with engine.begin() as c:
            rows.insert(c, [rows.Outgoing("r", {"properties": {}, "body": "y"})])
        assert len(live.claim("r", 1)) == 1
        assert len(live.claim("r", 1)) == 0
        assert not [t for t in threading.enumerate() if t.name == "durable-broker-leases"]
        deadline = time.monotonic() + 2.5  # four TTLs: only the keeper's beat can have kept the row
        while time.monotonic() < deadline:
            assert rows.claim(engine, "r", 10, "thief", 30) == []
            time.sleep(0.1)
    finally:
        live.close()
    assert heartbeat._beats == {}  # closed: the keeper renews nothing of it any more
    # Its row, no longer renewed, lapses one TTL later.
    deadline = time.monotonic() + 5
    while not rows.claim(engine, "r", 10, "thief", 30):
        assert time.monotonic() < deadline, "the closed holder's row never lapsed"
        time.sleep(0.05)


def _run_until_the_loop_idles(loop: Iterator[Any], idle: float = 0.5, deadline: float = 10) -> None:
    """Turn the loop until one turn blocks in its poll for ``idle`` seconds: it had nothing ready, so
    its start-up work (the LISTEN, the first fetch) is done. A fixed count of turns cost 2 s each once
    the loop was idle (its poll waits for the next timer)."""
    started = time.monotonic()
    while True:
        turn_started = time.monotonic()
        next(loop)
        if time.monotonic() - turn_started >= idle:
            return
        assert time.monotonic() - started < deadline, "the event loop never went idle"


def test_in_an_event_loop_the_listen_socket_wakes_the_consumer_on_a_notify_of_its_queue(db_url: str) -> None:
    from kombu import Connection, Exchange, Queue
    from kombu.asynchronous import Hub

    register()
    queue = Queue("q", Exchange("q"), "q")
    hub = Hub()
    got: list[float] = []
    with Connection(f"durable+{db_url}") as consumer, Connection(f"durable+{db_url}") as producer:
        consumer.connect()
        consumer.transport.polling_interval = 60  # only the NOTIFY can explain a pickup
        with consumer.Consumer([queue], callbacks=[lambda body, m: (got.append(time.monotonic()), m.ack())],
                               prefetch_count=10):
            consumer.transport.register_with_event_loop(consumer.connection, hub)
            loop = hub.create_loop()
            _run_until_the_loop_idles(loop)  # the LISTEN is open, nothing pending
            for n in range(3):
                sent = time.monotonic()
                producer.Producer().publish({"n": n}, exchange=queue.exchange, routing_key="q", declare=[queue])
                while len(got) <= n:
                    assert time.monotonic() - sent < 5, "the NOTIFY never woke the loop"
                    next(loop)
                assert got[n] - sent < 0.5
    hub.close()


@pytest.mark.parametrize(("asked", "with_rows", "also_present"), [
    (200, {"q199": 3}, 0),                      # the skip scan finds the one queue with rows
    (20, {"q000": 2, "q007": 1, "q019": 4}, 0),
    (20, {"q003": 2, "q011": 2}, 40),            # more queues in the table than asked: every asked queue probed
    (12, {"q005": 1}, 3),
])
def test_a_pass_over_many_queues_asks_as_the_pure_sweep_plans(db_url: str, asked: int, with_rows: dict[str, int],
                                                             also_present: int) -> None:
    from tests.integration.test_pg_broker import _planned

    engine = ensure_schema(db_url)
    queues = [f"q{i:03d}" for i in range(asked)]
    with engine.begin() as c:
        rows.insert(c, [rows.Outgoing(q, {"properties": {}, "body": f"{q}-{i}"})
                        for q, n in with_rows.items() for i in range(n)])
        # Queues this worker does not read, and a held row (present, not ready) in one it does.
        rows.insert(c, [rows.Outgoing(f"other{i:03d}", {"properties": {}, "body": "o"}) for i in range(also_present)])
        rows.insert(c, [rows.Outgoing(queues[1], {"properties": {}, "body": "held"})])
    rows.claim(engine, queues[1], 1, "someone", 30)
    ready = {q: with_rows.get(q, 0) for q in queues}
    free = {q: 2 for q in queues}
    asks = rows.claim_pass(engine, queues, [free[q] for q in queues], 5, "h", 30)
    assert [(a.queue, a.count, a.taken) for a in asks] == _planned(queues, ready, free, 5)


def test_random_passes_ask_as_the_pure_sweep_plans_one_queue_or_many(db_url: str) -> None:
    """Seeded random passes (1 to 12 queues, some empty, some full, with and without a process cap):
    the server's asks are the pure sweep's, ask for ask — the one-queue pass without a ready probe and
    the many-queue pass that visits only queues worth an ask included (migration 0011)."""
    import random

    from tests.integration.test_pg_broker import _planned

    engine = ensure_schema(db_url)
    generator = random.Random(20261206)
    for case in range(60):
        queues = [f"r{case}-{i:02d}" for i in range(generator.choice([1, 1, 2, 3, 9, 12]))]
        ready = {q: generator.choice([0, 0, 1, 2, 5]) for q in queues}
        free = {q: generator.choice([0, 1, 2, 4]) for q in queues}
        room = generator.choice([None, 0, 1, 2, 3, 7])
        with engine.begin() as c:
            c.execute(sa.text("DELETE FROM durable_broker_messages"))
            rows.insert(c, [rows.Outgoing(q, {"properties": {}, "body": f"{q}-{i}"})
                            for q in queues for i in range(ready[q])])
        asks = rows.claim_pass(engine, queues, [free[q] for q in queues], room, "h", 30)
        assert [(a.queue, a.count, a.taken) for a in asks] == _planned(queues, ready, free, room), \
            (case, ready, free, room)


def test_a_busy_claimer_leaves_out_queues_known_empty_until_a_notify_names_one_or_their_proof_ages(
        db_url: str) -> None:
    """A worker at its cap on one queue of 20 asks only that queue, not all 20, on each freed slot; a
    publish to another queue (its NOTIFY) puts that queue back in the very next pass, in its turn; a row
    that comes back with no NOTIFY (a dead holder's lapsed lease) waits for the last full pass's proof to
    age past KNOWN_EMPTY_FOR, then the full pass takes it; a narrowed pass that leaves room is followed by
    a full one at once."""
    import select
    from types import SimpleNamespace

    from kombu import Connection, Exchange, Queue

    from celery_durable.planning.known_empty import KNOWN_EMPTY_FOR
    from celery_durable.testing.clock import FakeClock
    from celery_durable.worker.claimer import Claimer
    from celery_durable.worker.held_runs import HeldRuns

    register()
    # Names of this test's own: NOTIFY is database-wide, and another test's publish to a "q003" in its own
    # schema of the same database would name a queue of this one.
    prefix = f"busy-{uuid.uuid4().hex[:6]}-"
    names = [f"{prefix}q{i:03d}" for i in range(20)]
    queues = [Queue(name, Exchange(name), name) for name in names]
    engine = ensure_schema(db_url)
    clock = FakeClock(monotonic=100.0)
    with Connection(f"durable+{db_url}") as conn, Connection(f"durable+{db_url}") as producer:
        conn.connect()
        backend = conn.transport.rows
        listen_fds = backend.wakeup_fds()  # the LISTEN a worker's hub opens
        asked: list[int] = []  # queues in each claim statement (a pass over one is the one-queue claim)

        def claim_statement(sql: str, params: Any) -> None:
            if "durable_broker_claim_pass(" in sql:
                asked.append(len(params["queues"].split(",")))
            elif "durable_broker_claim(" in sql:
                asked.append(1)

        backend.hot.listen(claim_statement)

        def publish(queue: str, count: int) -> None:
            channel = producer.default_channel
            messages = [channel.prepare_message(channel.encode_body(json.dumps({"q": queue}))[0],
                                                content_type="application/json", content_encoding="utf-8")
                        for _ in range(count)]
            Queue(queue, Exchange(queue), queue)(channel).declare()
            channel.basic_publish_many(messages, queue, queue)
            # Its own NOTIFY read by the claimer's LISTEN: another test's, on the same database-wide channel,
            # can make the socket readable first.
            deadline = time.monotonic() + 5
            while not backend._wakeups().heard(queue):
                assert time.monotonic() < deadline, "the publish's NOTIFY never arrived"
                select.select(listen_fds, [], [], 0.05)

        got: list[Any] = []
        scheduled: list[Any] = []
        held = HeldRuns(1, {name: 1 for name in names})
        claimer = Claimer(connection=conn, queues=lambda: queues, held=held, accept=["json"],
                          schedule=scheduled.append, clock=clock)

        def handle(message: Any) -> None:
            # As Celery's strategy does: a request for the message (it holds its slot until it ends).
            got.append(message)
            claimer.bind_request(SimpleNamespace(message=message, eta=None, _eta_timer_entry=None))

        claimer.handler = handle

        def next_run() -> str:
            """The run held ends (acked, its slot given back); the pass that follows: the queue it took from."""
            before = len(got)
            run = got[-1]
            held.give_back(run)
            run.ack()
            scheduled.clear()
            claimer.run_pass()
            return str(json.loads(got[-1].body)["q"]) if len(got) > before else ""

        publish(prefix + "q019", 50)
        try:
            claimer.start()  # nothing known yet: a full pass
            assert asked[-1] == 20 and len(got) == 1
            assert next_run() == prefix + "q019" and asked[-1] == 1  # q000..q018 proved empty: left out
            assert next_run() == prefix + "q019" and asked[-1] == 1

            publish(prefix + "q005", 1)
            # Back in the next pass, in its turn after the cursor (q019): before q019.
            assert next_run() == prefix + "q005" and asked[-1] == 2
            # q005 gave all it was asked (one): not known empty until a pass asks it and it gives less.
            assert next_run() == prefix + "q019" and asked[-1] == 2  # room ran out at q019: q005 not asked
            assert next_run() == prefix + "q019" and asked[-1] == 2  # q005 asked first, gave nothing
            assert next_run() == prefix + "q019" and asked[-1] == 1

            # A message on q003 taken by a holder that dies: its NOTIFY put q003 back in a pass, which
            # found it held and left it out again. Its lease lapses with no NOTIFY.
            publish(prefix + "q003", 1)
            assert rows.claim(engine, prefix + "q003", 1, "dies", DYING_TTL)
            assert next_run() == prefix + "q019" and asked[-1] == 2
            with engine.connect() as c:
                lapsed = sa.text("SELECT count(*) FROM durable_broker_messages "
                                 "WHERE queue = :q AND lease_expires_at < clock_timestamp()")
                deadline = time.monotonic() + 10
                while not c.execute(lapsed, {"q": prefix + "q003"}).scalar():
                    assert time.monotonic() < deadline, "the dying holder's lease never lapsed"
                    time.sleep(0.05)
            # Ready again, and no NOTIFY said so: left out while the full pass's proof is young ...
            clock.advance(KNOWN_EMPTY_FOR / 2)
            assert next_run() == prefix + "q019" and asked[-1] == 1
            # ... taken, in its turn, by the full pass once the proof has aged.
            clock.advance(KNOWN_EMPTY_FOR)
            assert next_run() == prefix + "q003" and asked[-1] == 20

            # q019 emptied behind the claimer's back (no NOTIFY): the narrowed pass finds nothing and
            # still has room, so a full pass follows at once, not an idle wait.
            assert next_run() == prefix + "q019" and asked[-1] < 20
            with engine.begin() as c:
                c.execute(sa.text("DELETE FROM durable_broker_messages WHERE queue = :q AND holder IS NULL"),
                          {"q": prefix + "q019"})
            assert next_run() == "" and asked[-1] < 20
            assert len(scheduled) == 1
            scheduled.pop()()
            assert asked[-1] == 20
        finally:
            claimer.close()


def test_the_listen_connection_tells_the_claimer_and_the_wake_up_each_what_was_notified(db_url: str) -> None:
    """A claimer's record of notified queues and the transport's wake-ups read the same LISTEN, each
    forgetting only what it was told; before LISTEN is open, or after it broke, the record says None
    (a notification may have been missed) once."""
    import select

    from celery_durable.store.notify import Waker

    engine = ensure_schema(db_url)
    waker = Waker(engine, channel=rows.CHANNEL)
    try:
        assert waker.take_seen() is None  # not listening yet
        fds = waker.fds()  # opens LISTEN
        assert waker.take_seen() is None  # notifications before it opened were not heard
        assert waker.take_seen() == set()

        def insert(queue: str) -> None:
            with engine.begin() as c:
                rows.insert(c, [rows.Outgoing(queue, {"properties": {}, "body": "x"})])
            assert select.select(fds, [], [], 5)[0], "the NOTIFY never arrived"

        insert("a")
        assert waker.take() == (False, {"a"})  # the wake-up's reader
        insert("b")
        assert waker.take_seen() == {"a", "b"}  # the claimer's: both, though the wake-up read "a" first
        # "b" was read off the socket by the claimer: the event loop's reader is woken all the same.
        assert select.select(fds, [], [], 0)[0]
        assert waker.take() == (True, {"b"})
        assert waker.take_seen() == set()

        waker._drop()  # LISTEN broke
        insert_without_listen = rows.Outgoing("c", {"properties": {}, "body": "x"})
        with engine.begin() as c:
            rows.insert(c, [insert_without_listen])
        fds = waker.fds()  # reopened
        assert waker.take_seen() is None
        insert("d")
        assert waker.take_seen() == {"d"}
    finally:
        waker.close()


def _dead_rows(db_url: str) -> int:
    with ensure_schema(db_url).connect() as c:
        return int(c.exec_driver_sql(
            "SELECT coalesce(pg_stat_get_dead_tuples(to_regclass('durable_broker_messages')), 0)").scalar() or 0)


@pytest.fixture
def own_database_url() -> Iterator[str]:
    with fresh_database() as url:
        ensure_schema(url)
        yield url


def test_a_claiming_worker_vacuums_the_dead_rows_its_claims_and_acks_leave_and_stops_when_it_closes(
        own_database_url: str) -> None:
    from celery_durable.broker import vacuum

    # A database of its own: the other test process's open transactions would keep the dead rows.
    db_url = own_database_url
    engine = ensure_schema(db_url)
    live = PgRows(db_url, lease_ttl=30, vacuum_dead_rows=500)
    table_vacuum = vacuum.for_process(live.engine, 500)
    try:
        with engine.begin() as c:
            rows.insert(c, [rows.Outgoing("v", {"properties": {}, "body": str(n)}) for n in range(600)])
        taken = live.claim("v", 600)
        assert len(taken) == 600
        assert table_vacuum.checking  # the first claim started this process's checks
        for payload in taken:
            live.ack(payload["properties"]["delivery_tag"])
        live.flush_acks()  # 600 claims and 600 deletes: 1,200 dead row versions
        # A busy backend reports them about once a second, an idle one within 10 s: this one reports now.
        live.hot.execute("SELECT pg_stat_force_next_flush()", {})
        deadline = time.monotonic() + 30
        while table_vacuum.vacuums == 0:
            assert time.monotonic() < deadline, f"no VACUUM came; dead rows: {_dead_rows(db_url)}"
            time.sleep(0.1)
        assert _dead_rows(db_url) < 500
    finally:
        live.close()
    assert not table_vacuum.checking  # the last holder closed: no thread looks at a store that may be gone


def test_a_threshold_of_zero_leaves_the_table_to_autovacuum(db_url: str) -> None:
    from celery_durable.broker import vacuum

    engine = ensure_schema(db_url)
    live = PgRows(db_url, lease_ttl=30, vacuum_dead_rows=0)
    try:
        with engine.begin() as c:
            rows.insert(c, [rows.Outgoing("z", {"properties": {}, "body": "x"})])
        assert len(live.claim("z", 1)) == 1
        assert not vacuum.for_process(live.engine, 0).checking
    finally:
        live.close()
