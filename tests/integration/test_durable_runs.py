"""Durable runs and steps on a real store (PostgreSQL and SQLite): checkpoints, retries, dead runs, faults."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import uuid
from datetime import datetime, timezone
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

import celery_durable
from celery_durable import faults
from celery_durable.errors import NotJSON, RunNotDead, SchemaOutdated, StoreUnavailable
from celery_durable.metrics import jobs as metrics
from celery_durable.store.engine import engine_for
from celery_durable.store.schema import VERSION_TABLE
from celery_durable.tasks import runs as durable_runs
from tests.e2e.harness import wait_for
from tests.services import REDIS_URL, redis_problem, require
from tests.stores import fresh_store


def make_app(store_url: str, **conf: Any) -> Celery:
    app = Celery(f"it{uuid.uuid4().hex[:6]}", broker=REDIS_URL)
    celery_durable.install(app)
    app.conf.update(durable_database_url=store_url, task_default_queue=f"it-{uuid.uuid4().hex[:8]}", **conf)
    return app


def run_row(store_url: str, run_id: str) -> Any:
    return durable_runs.get(run_id, app=make_app(store_url))


def step_rows(store_url: str, run_id: str) -> list[tuple[str, int, str]]:
    with engine_for(store_url).connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(
            "SELECT name, occurrence, result FROM durable_steps WHERE run_id = :id ORDER BY name, occurrence"
        ), {"id": run_id})]


def test_a_step_runs_once_and_a_replay_returns_its_checkpoint(store_url):
    app = make_app(store_url)
    calls: list[str] = []
    failures = {"left": 1}

    def effect(label: str, value: Any) -> Any:
        calls.append(label)
        return value

    def reserve_all() -> None:
        # From a plain function: celery_durable.step finds the run by context.
        for line in ("a", "b"):
            celery_durable.step("reserve", effect, f"reserve-{line}", {"line": line})

    @app.durable_task(shared=False, bind=True, max_retries=3, default_retry_delay=0)
    def fulfil(self, order_id: int) -> dict:
        charge = self.step("charge", effect, "charge", {"id": f"ch-{order_id}"})
        reserve_all()
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("the mail server is down")
        self.step("receipt", effect, "receipt", charge["id"])
        return charge

    result = fulfil.apply((7,), task_id="run-1")
    assert result.successful(), result.traceback
    assert result.result == {"id": "ch-7"}
    # The retry replayed charge and both reserves from their checkpoints.
    assert calls == ["charge", "reserve-a", "reserve-b", "receipt"]
    assert step_rows(store_url, "run-1") == [
        ("charge", 0, '{"id":"ch-7"}'), ("receipt", 0, '"ch-7"'),
        ("reserve", 0, '{"line":"a"}'), ("reserve", 1, '{"line":"b"}'),
    ]
    run = run_row(store_url, "run-1")
    assert (run.state, run.attempts, run.result, run.args) == ("succeeded", 2, '{"id":"ch-7"}', "[7]")
    assert run.finished_at is not None
    assert run.last_error == "RuntimeError: the mail server is down"


def test_a_step_failing_twice_then_succeeding_leaves_earlier_steps_run_once(store_url):
    app = make_app(store_url)
    calls: list[str] = []

    def flaky() -> str:
        calls.append("flaky")
        if calls.count("flaky") <= 2:
            raise ConnectionError(f"attempt {calls.count('flaky')} failed")
        return "ok"

    @app.durable_task(shared=False, bind=True, max_retries=5, default_retry_delay=0)
    def job(self) -> str:
        self.step("first", lambda: calls.append("first") or 1)
        return self.step("flaky", flaky)

    result = job.apply(task_id="run-2")
    assert result.successful(), result.traceback
    assert calls == ["first", "flaky", "flaky", "flaky"]
    run = run_row(store_url, "run-2")
    assert (run.state, run.attempts) == ("succeeded", 3)
    assert [r[0] for r in step_rows(store_url, "run-2")] == ["first", "flaky"]


def test_a_result_that_is_not_json_stores_nothing_and_names_the_step(store_url):
    app = make_app(store_url)

    @app.durable_task(shared=False, bind=True, max_retries=5, default_retry_delay=0)
    def job(self) -> None:
        self.step("ok", lambda: 1)
        self.step("when", lambda: (1, 2))

    result = job.apply(task_id="run-3")
    assert isinstance(result.result, NotJSON)
    assert "step 'when'" in str(result.result) and "tuple" in str(result.result)
    assert [r[0] for r in step_rows(store_url, "run-3")] == ["ok"]
    # No retry can fix it: the run is buried at once, not after five retries.
    run = run_row(store_url, "run-3")
    assert (run.state, run.attempts) == ("dead", 1)
    assert "NotJSON" in run.last_error


def test_a_dead_run_calls_its_hook_once_counts_and_requeues_without_rerunning_steps(store_url):
    require("Redis", redis_problem())
    app = make_app(store_url)
    calls: list[str] = []
    settled: list[Any] = []
    broken = {"on": True}

    def charge() -> str:
        calls.append("charge")
        return "ch-1"

    def ship() -> str:
        calls.append("ship")
        if broken["on"]:
            raise RuntimeError("carrier rejected the parcel")
        return "shipped"

    @app.durable_task(shared=False, bind=True, max_retries=1, default_retry_delay=0, on_settled=settled.append)
    def order(self, n: int) -> str:
        self.step("charge", charge)
        return self.step("ship", ship)

    queue = app.conf.task_default_queue
    before = metrics.value(None, "dead_lettered")
    result = order.apply((1,), task_id="run-4")
    assert result.failed()
    assert calls == ["charge", "ship", "ship"]
    assert [(r.id, r.state) for r in settled] == [("run-4", "dead")]
    assert "carrier rejected" in settled[0].last_error
    assert metrics.value(None, "dead_lettered") == before + 1

    broken["on"] = False
    reopened = durable_runs.requeue("run-4", app=app)
    assert reopened.state == "failed"
    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert client.llen(queue) == 1, "requeue did not publish the run"
    finally:
        client.delete(queue)
    # Deliver it as a worker would (same id): the charge is not made again.
    again = order.apply((1,), task_id="run-4")
    assert again.successful(), again.traceback
    assert calls == ["charge", "ship", "ship", "ship"]
    assert run_row(store_url, "run-4").state == "succeeded"
    assert [(r.id, r.state) for r in settled] == [("run-4", "dead"), ("run-4", "succeeded")]
    with pytest.raises(RunNotDead):
        durable_runs.requeue("run-4", app=app)


def test_a_delivery_of_a_settled_run_does_not_run_the_body(store_url):
    app = make_app(store_url)
    calls: list[str] = []

    @app.durable_task(shared=False, bind=True)
    def job(self) -> str:
        calls.append("body")
        return "done"

    assert job.apply(task_id="run-5").result == "done"
    before = metrics.value(None, "duplicate")
    assert job.apply(task_id="run-5").result == "done"
    assert calls == ["body"]
    assert metrics.value(None, "duplicate") == before + 1
    assert run_row(store_url, "run-5").attempts == 1


def _orders_table(store_url: str) -> None:
    with engine_for(store_url).begin() as conn:
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS e2e_orders (run_id VARCHAR(64), n INTEGER)")


def _place(conn: Any, run_id: str, n: int) -> int:
    conn.execute(sa.text("INSERT INTO e2e_orders (run_id, n) VALUES (:r, :n)"), {"r": run_id, "n": n})
    return n


def _transactional_app(store_url: str) -> Any:
    # A short lease: the killed attempt's lease must expire before a redelivery may take the run.
    app = make_app(store_url, durable_lease_ttl=0.5)

    @app.durable_task(shared=False, bind=True, name="it.place")
    def place(self, n: int) -> int:
        return self.step("place", _place, self.request.id, n, transactional=True)

    return place


def _run_with_fault(store_url: str, run_id: str, point: str) -> None:
    def die(reached: str) -> None:
        if reached == point:
            os._exit(17)

    place = _transactional_app(store_url)
    faults.install(place.app, die)
    place.apply((3,), task_id=run_id)
    os._exit(0)


def _counts(store_url: str, run_id: str) -> tuple[int, int]:
    with engine_for(store_url).connect() as conn:
        rows = conn.execute(sa.text("SELECT count(*) FROM e2e_orders WHERE run_id = :r"), {"r": run_id}).scalar()
        checkpoints = conn.execute(sa.text("SELECT count(*) FROM durable_steps WHERE run_id = :r"),
                                   {"r": run_id}).scalar()
    return int(rows), int(checkpoints)


@pytest.mark.parametrize("point", faults.POINTS)
def test_a_transactional_steps_row_and_checkpoint_survive_a_kill_together(store_url, point):
    _orders_table(store_url)
    run_id = f"run-fault-{point}"
    # A forked process dies at the fault point, as a SIGKILLed worker child would.
    child = multiprocessing.get_context("fork").Process(target=_run_with_fault, args=(store_url, run_id, point))
    child.start()
    child.join(30)
    assert child.exitcode == 17, f"the child did not reach {point}"
    rows, checkpoints = _counts(store_url, run_id)
    assert rows == checkpoints, f"after a kill at {point}: {rows} rows, {checkpoints} checkpoints"
    assert (rows, checkpoints) == ((1, 1) if point == faults.AFTER_COMMIT else (0, 0))
    # The killed attempt still holds the run until its lease expires; then a redelivery
    # takes it over (a lost attempt) and completes it exactly once.
    wait_for(lambda: not run_row(store_url, run_id).lease_live(datetime.now(timezone.utc)), timeout=10,
             what="the killed attempt's lease to expire")
    assert _transactional_app(store_url).apply((3,), task_id=run_id).result == 3
    assert run_row(store_url, run_id).lost_attempts == 1
    assert _counts(store_url, run_id) == (1, 1)


def test_a_transactional_step_that_raises_leaves_neither_row_nor_checkpoint(store_url):
    _orders_table(store_url)
    app = make_app(store_url)

    def place_then_fail(conn: Any, run_id: str) -> None:
        _place(conn, run_id, 1)
        raise ValueError("the price changed")

    @app.durable_task(shared=False, bind=True, max_retries=0)
    def job(self) -> None:
        self.step("place", place_then_fail, self.request.id, transactional=True)

    assert isinstance(job.apply(task_id="run-6").result, ValueError)
    assert _counts(store_url, "run-6") == (0, 0)


def test_a_store_that_is_down_fails_the_attempt_with_nothing_recorded(store_url, tmp_path):
    down = ("postgresql+psycopg2://postgres@127.0.0.1:1/test" if store_url.startswith("postgresql")
            else f"sqlite:///{tmp_path}/no/such/dir/durable.sqlite")
    app = make_app(down)
    calls: list[str] = []

    @app.durable_task(shared=False, bind=True, max_retries=2, default_retry_delay=0)
    def job(self) -> None:
        calls.append("body")

    result = job.apply(task_id="run-7")
    assert isinstance(result.result, StoreUnavailable)
    assert "unavailable" in str(result.result)
    assert calls == []
    # Not one of the errors that bury a run at once (in a worker the delivery waits for the
    # store: re-sent, no retry spent; an eager run raises it), and it survives pickling.
    assert result.result.__class__ not in job.dont_autoretry_for
    assert isinstance(pickle.loads(pickle.dumps(result.result)), StoreUnavailable)


def test_a_schema_older_than_the_code_is_refused_with_the_migrate_command(store_url):
    with engine_for(store_url).begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {VERSION_TABLE} (version_num VARCHAR(32) NOT NULL)")
        conn.exec_driver_sql(f"INSERT INTO {VERSION_TABLE} VALUES ('0000_older')")
    app = make_app(store_url)

    @app.durable_task(shared=False, bind=True)
    def job(self) -> None:
        pass

    result = job.apply(task_id="run-8")
    assert isinstance(result.result, SchemaOutdated)
    assert "0000_older" in str(result.result) and "durable migrate" in str(result.result)


def test_a_cancel_settles_a_run_once_and_wins_over_a_later_outcome(store_url):
    from celery.app.task import Context

    from celery_durable.tasks.revocation import cancel_revoked

    app = make_app(store_url)
    settled: list[Any] = []
    calls: list[str] = []

    @app.durable_task(shared=False, bind=True, name="it.cancellable", on_settled=settled.append)
    def job(self, n: int) -> str:
        calls.append("body")
        if n == 2:
            # Revoked (terminate=True) while running: the worker cancels it before this attempt ends.
            cancel_revoked(self, Context(id=self.request.id, args=[n], kwargs={}), reason="revoked: terminated")
        return "done"

    before = metrics.value(None, "cancelled")
    # Revoked before it ever ran: recorded cancelled, so no delivery runs it.
    cancelled = cancel_revoked(job, Context(id="run-c1", args=[1], kwargs={}), reason="revoked")
    assert (cancelled.state, cancelled.attempts, cancelled.args, cancelled.last_error) == (
        "cancelled", 0, "[1]", "revoked")
    assert job.apply((1,), task_id="run-c1").state == "IGNORED"
    assert calls == []
    # A second revoke of a settled run changes nothing and calls nothing.
    assert cancel_revoked(job, Context(id="run-c1", args=[1], kwargs={}), reason="revoked") is None

    job.apply((2,), task_id="run-c2")
    run = run_row(store_url, "run-c2")
    assert (run.state, run.result, run.last_error) == ("cancelled", None, "revoked: terminated")
    assert [(r.id, r.state) for r in settled] == [("run-c1", "cancelled"), ("run-c2", "cancelled")]
    assert metrics.value(None, "cancelled") == before + 2
    assert calls == ["body"]


def test_an_eager_run_sleeps_without_waiting_and_carries_on(store_url):
    app = make_app(store_url)
    app.conf.task_always_eager = True
    calls: list[str] = []

    @app.durable_task(shared=False, bind=True)
    def remind(self) -> str:
        self.step("before", lambda: calls.append("before"))
        self.sleep("a-day", 86400)
        self.step("after", lambda: calls.append("after"))
        return "reminded"

    result = remind.delay()
    assert result.get(timeout=10) == "reminded"
    assert calls == ["before", "after"]
    run = run_row(store_url, result.id)
    assert (run.state, run.attempts) == ("succeeded", 1)
    # The wake time is still a checkpoint, a day ahead.
    assert [r[0] for r in step_rows(store_url, result.id)] == ["a-day", "after", "before"]


def test_an_eager_requeue_runs_the_dead_run_here_without_rerunning_its_steps(store_url):
    app = make_app(store_url)
    app.conf.task_always_eager = True
    calls: list[str] = []
    broken = {"on": True}

    def ship() -> str:
        calls.append("ship")
        if broken["on"]:
            raise RuntimeError("carrier rejected the parcel")
        return "shipped"

    @app.durable_task(shared=False, bind=True, max_retries=0)
    def order(self) -> str:
        self.step("charge", lambda: calls.append("charge") or "ch-1")
        return self.step("ship", ship)

    result = order.delay()
    assert result.failed()
    assert run_row(store_url, result.id).state == "dead"
    broken["on"] = False
    requeued = durable_runs.requeue(result.id, app=app)
    assert (requeued.state, requeued.result) == ("succeeded", '"shipped"')
    assert calls == ["charge", "ship", "ship"]


def test_every_store_connection_bounds_a_lost_database_host_unless_its_url_says_otherwise(tmp_path):
    """A PostgreSQL host that vanishes sends no RST: without keepalives and a TCP user timeout a
    statement would wait on it for hours, the worker's claim loop with it. Both engines (in a
    transaction and in autocommit) connect with them; a value in the URL wins."""
    from celery_durable.store.engine import PG_NETWORK_TIMEOUTS, autocommit

    with fresh_store("postgresql", tmp_path) as url:
        for engine in (engine_for(url), autocommit(engine_for(url))):
            with engine.connect() as conn:
                given = conn.connection.dbapi_connection.get_dsn_parameters()
            assert {name: given.get(name) for name in PG_NETWORK_TIMEOUTS} == \
                {name: str(value) for name, value in PG_NETWORK_TIMEOUTS.items()}
        own = f"{url}{'&' if '?' in url else '?'}tcp_user_timeout=5000"
        with engine_for(own).connect() as conn:
            assert conn.connection.dbapi_connection.get_dsn_parameters()["tcp_user_timeout"] == "5000"


def _take_over(store_url: str, run_id: str, survivor_steps: tuple[str, ...] = ()) -> None:
    """What another worker's takeover leaves once this attempt's process froze past its lease: the run
    held by the survivor's token, and the checkpoints of the steps the survivor got through."""
    with engine_for(store_url).begin() as conn:
        conn.execute(sa.text("UPDATE durable_runs SET lease_holder = 'survivor', attempts = attempts + 1 "
                             "WHERE id = :r"), {"r": run_id})
        for name in survivor_steps:
            conn.execute(sa.text("INSERT INTO durable_steps (run_id, name, occurrence, result, created_at) "
                                 "VALUES (:r, :n, 0, '\"survivor\"', :at)"),
                         {"r": run_id, "n": name, "at": datetime.now(timezone.utc)})


@pytest.mark.parametrize("transactional", [False, True], ids=["plain", "transactional"])
def test_an_attempt_taken_over_mid_run_records_no_step_and_ends_without_a_retry_or_a_failure(
        store_url, transactional, caplog):
    """The stale holder's step meets the lease fence: a plain step the survivor already checkpointed (a
    duplicate key before the fence: an ordinary error, so a retry and a failure) or a transactional step
    the survivor has not reached (committed for a run it no longer held, before the fence). Either way
    the attempt ends as Ignore: no retry, nothing failed, no row of fn's, the run left to the survivor."""
    _orders_table(store_url)
    app = make_app(store_url)
    calls: list[str] = []
    run_id = f"run-stale-{'tx' if transactional else 'plain'}"

    def frozen_past_the_lease() -> str:
        calls.append("fn")
        _take_over(store_url, run_id, survivor_steps=("step",))
        return "stale"

    def place(conn: Any) -> str:
        calls.append("fn")
        _place(conn, run_id, 1)  # in the checkpoint's transaction: must roll back with it
        return "stale"

    @app.durable_task(shared=False, bind=True, max_retries=3, default_retry_delay=0)
    def job(self) -> str:
        calls.append("body")
        if transactional:
            # Frozen just before the step (SQLite: a takeover cannot commit inside the step's transaction).
            _take_over(store_url, run_id)
            self.step("step", place, transactional=True)
        else:
            self.step("step", frozen_past_the_lease)
        calls.append("after")
        return "stale"

    failed, dead = metrics.value(None, "failed"), metrics.value(None, "dead_lettered")
    with caplog.at_level("INFO", logger="celery_durable.run"):
        result = job.apply(task_id=run_id)
    assert result.state == "IGNORED", result.traceback
    assert calls == ["body", "fn"]  # ended at the fenced step; no retry ran the body again
    assert (metrics.value(None, "failed"), metrics.value(None, "dead_lettered")) == (failed, dead)
    assert step_rows(store_url, run_id) == ([] if transactional else [("step", 0, '"survivor"')])
    assert _counts(store_url, run_id)[0] == 0, "the stale attempt's transactional step committed"
    run = run_row(store_url, run_id)
    assert (run.state, run.lease_holder, run.attempts, run.last_error) == ("running", "survivor", 2, None)
    [lost] = [r for r in caplog.records if getattr(r, "event", None) == "durable.run.lease_lost"]
    assert (lost.run_id, lost.step, lost.levelname) == (run_id, "step", "WARNING")


def _outcome_app(store_url: str, outcome: str, settled: list[Any]) -> Any:
    app = make_app(store_url)

    @app.durable_task(shared=False, bind=True, max_retries=0, on_settled=settled.append)
    def job(self) -> str:
        if outcome == "dead":
            raise ValueError("the parcel is lost")
        return "done"

    return job


def _lose_the_settle(monkeypatch: Any, outcome: str, *, landed: bool) -> list[str]:
    """The first settle of ``outcome`` fails as a cut connection does: after its COMMIT (``landed``: only
    the reply is lost) or before it. Returns the settling attempt's token once it is seen."""
    from celery_durable.store import runs as store_runs

    settlers: list[str] = []
    real_settle = store_runs.settle

    def settle_then_cut(conn: Any, run: Any, state: str, **kw: Any) -> Any:
        if state != outcome or settlers:
            return real_settle(conn, run, state, **kw)
        settlers.append(run.lease_holder)
        if landed:
            real_settle(conn, run, state, **kw)
        raise StoreUnavailable("the durable store is unavailable: server closed the connection unexpectedly")

    monkeypatch.setattr(store_runs, "settle", settle_then_cut)
    return settlers


@pytest.mark.parametrize("landed", [True, False], ids=["reply-lost", "request-lost"])
@pytest.mark.parametrize("outcome", ["succeeded", "dead"])
def test_a_settle_cut_off_is_reported_once_by_its_attempt_when_the_store_answers(store_url, outcome, landed,
                                                                                 monkeypatch, caplog):
    """The settle's connection is cut: its COMMIT landed and only the reply was lost, or it never landed.
    The attempt waits in place for the store and then claims the outcome its token wrote (or writes it):
    one count, one on_settled call, and a later copy of the message is a plain duplicate."""
    settled: list[Any] = []
    job = _outcome_app(store_url, outcome, settled)
    settlers = _lose_the_settle(monkeypatch, outcome, landed=landed)
    count = "succeeded" if outcome == "succeeded" else "dead_lettered"
    before = metrics.value(None, count)
    run_id = f"run-cut-settle-{outcome}-{landed}"
    with caplog.at_level("INFO", logger="celery_durable.run"):
        result = job.apply(task_id=run_id)
    assert result.state == ("SUCCESS" if outcome == "succeeded" else "FAILURE"), result.traceback
    assert len(settlers) == 1
    assert [(r.id, r.state) for r in settled] == [(run_id, outcome)]
    assert metrics.value(None, count) == before + 1
    recovered = [r for r in caplog.records if getattr(r, "event", None) == "durable.run.settle_recovered"]
    assert len(recovered) == (1 if landed else 0)
    assert run_row(store_url, run_id).settled_by == (None if landed else settlers[0])
    job.apply(task_id=run_id)  # the message again: a duplicate
    assert len(settled) == 1 and metrics.value(None, count) == before + 1


@pytest.mark.parametrize("outcome", ["succeeded", "dead"])
def test_a_settle_whose_reply_was_lost_is_reported_once_by_its_settlers_re_send(store_url, outcome, monkeypatch,
                                                                                caplog):
    """The settle's COMMIT landed, its reply was lost, and the store stayed away past the attempt's wait in
    place: it counted nothing, called no hook and re-sent the run under its own token. That re-send (two
    copies of it here) finds the run settled by that very token: exactly one copy counts the outcome and
    calls on_settled; a copy without the token, and the second copy, are plain duplicates."""
    from celery_durable.headers import RESUME_HEADER
    from celery_durable.store import runs as store_runs
    from celery_durable.tasks import context

    settled: list[Any] = []
    job = _outcome_app(store_url, outcome, settled)
    settlers = _lose_the_settle(monkeypatch, outcome, landed=True)
    away = {"on": True}
    real_claim = store_runs.claim_unseen_outcome

    def claim_while_the_store_answers(conn: Any, run_id: str, settler: str) -> Any:
        if away["on"]:
            raise StoreUnavailable("the durable store is unavailable: connection refused")
        return real_claim(conn, run_id, settler)

    monkeypatch.setattr(store_runs, "claim_unseen_outcome", claim_while_the_store_answers)
    monkeypatch.setattr(context, "CHECKPOINT_WAIT", 0.5)
    count = "succeeded" if outcome == "succeeded" else "dead_lettered"
    before, duplicates = metrics.value(None, count), metrics.value(None, "duplicate")
    run_id = f"run-lost-reply-{outcome}"
    # Eager: the store wait raises instead of re-sending; a worker re-sends with the settler's token.
    assert isinstance(job.apply(task_id=run_id).result, StoreUnavailable)
    away["on"] = False
    assert run_row(store_url, run_id).state == outcome
    assert (settled, metrics.value(None, count)) == ([], before)
    [settler] = settlers

    assert job.apply(task_id=run_id).state in ("SUCCESS", "IGNORED")  # the original message again: a duplicate
    assert settled == []
    with caplog.at_level("INFO", logger="celery_durable.run"):
        first = job.apply(task_id=run_id, headers={RESUME_HEADER: settler})
        second = job.apply(task_id=run_id, headers={RESUME_HEADER: settler})
    expected = ("SUCCESS", "done") if outcome == "succeeded" else ("IGNORED", None)
    assert (first.state, first.result if outcome == "succeeded" else None) == expected
    assert [(r.id, r.state) for r in settled] == [(run_id, outcome)]
    assert metrics.value(None, count) == before + 1
    assert metrics.value(None, "duplicate") == duplicates + 2  # the original message's copy and `second`
    assert second.state == first.state
    [recovered] = [r for r in caplog.records if getattr(r, "event", None) == "durable.run.settle_recovered"]
    assert (recovered.run_id, recovered.state, recovered.by) == (run_id, outcome, "its re-send")


def test_a_checkpoint_whose_reply_was_lost_is_stored_once_and_spends_no_retry(store_url, monkeypatch):
    """A plain step's checkpoint INSERT commits but its reply is lost (the store cut): the step waits in place
    and tries again, meeting its own row. That is the checkpoint stored, not an error: before, the duplicate
    key failed the attempt and Celery's autoretry spent a retry on it (seen in the 20 s cut e2e)."""
    from celery_durable.store import steps as store_steps

    app = make_app(store_url)
    calls: list[str] = []
    cut: list[str] = []
    real_insert = store_steps.insert

    def insert_then_cut(conn: Any, run_id: str, key: Any, encoded: str, token: str) -> bool:
        written = real_insert(conn, run_id, key, encoded, token)
        if key.name == "charge" and not cut:
            cut.append(key.name)
            raise StoreUnavailable("the durable store is unavailable: server closed the connection unexpectedly")
        return written

    monkeypatch.setattr(store_steps, "insert", insert_then_cut)

    @app.durable_task(shared=False, bind=True, max_retries=3, default_retry_delay=0)
    def job(self) -> str:
        calls.append("body")
        self.step("charge", lambda: calls.append("charge") or "ch-1")
        return str(self.step("ship", lambda: calls.append("ship") or "shipped"))

    failed = metrics.value(None, "failed")
    result = job.apply(task_id="run-lost-checkpoint-reply")
    assert result.state == "SUCCESS", result.traceback
    assert cut == ["charge"] and calls == ["body", "charge", "ship"]
    assert metrics.value(None, "failed") == failed
    run = run_row(store_url, "run-lost-checkpoint-reply")
    assert (run.state, run.attempts, run.last_error) == ("succeeded", 1, None)
    assert [r[0] for r in step_rows(store_url, "run-lost-checkpoint-reply")] == ["charge", "ship"]
