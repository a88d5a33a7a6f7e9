"""The step context of one durable run: ``step()`` and ``sleep()`` against the run's checkpoints."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from celery_durable.errors import LeaseLost, NotDurable, SleepHandOff, StoreUnavailable
from celery_durable.faults import AFTER_COMMIT, BEFORE_COMMIT, BEFORE_FN, NO_FAULTS, FaultPoints
from celery_durable.headers import RESUME_HEADER
from celery_durable.planning.checkpoints import Ledger, check_step_name
from celery_durable.store import outage, runs, steps
from celery_durable.store.engine import autocommit, unavailable_as_error
from celery_durable.store.json_values import from_json, to_json
from celery_durable.store.runs import Run

logger = logging.getLogger("celery_durable.run")

#: Seconds a step whose fn already ran (or a settle whose reply was lost) waits in place for the store.
CHECKPOINT_WAIT = 60.0

T = TypeVar("T")


@dataclass
class RunContext:
    """What a running durable body's steps need: its run, its checkpoints and a connection."""

    task: Any
    run: Run
    ledger: Ledger
    conn: Connection  # autocommit: a checkpoint INSERT is its own transaction
    engine: Engine    # for transactional steps, which need a transaction of their own
    url: str
    token: str        # this attempt's lease token: fences its checkpoints; a durable sleep hands the run on with it
    faults: FaultPoints = NO_FAULTS  # where a crash test stops this process

    def step(self, name: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             transactional: bool = False) -> Any:
        key = self.ledger.next_key(name)
        stored = self.ledger.lookup(key)
        if stored is not None:
            return from_json(stored)
        if not callable(fn):
            raise TypeError(f"step {name!r}: fn must be callable, got {fn!r}")
        what = f"the result of step {name!r}" + (f" (occurrence {key.occurrence})" if key.occurrence else "")
        self.faults.reach(BEFORE_FN)
        if transactional:
            with unavailable_as_error(self.url), self.engine.begin() as tx:
                value = fn(tx, *args, **kwargs)
                # Checked inside the transaction: a result we refuse rolls fn's effects back.
                encoded = to_json(what, value)
                if not steps.insert_in(tx, self.run.id, key, encoded, self.token):
                    # Raised inside the transaction: fn's effects roll back with the refused checkpoint.
                    raise LeaseLost(self.run.id, str(name))
                self.faults.reach(BEFORE_COMMIT)
        else:
            value = fn(*args, **kwargs)
            encoded = to_json(what, value)
            self.faults.reach(BEFORE_COMMIT)
            if not self._checkpoint_when_the_store_answers(key, encoded):
                raise LeaseLost(self.run.id, str(name))
        self.faults.reach(AFTER_COMMIT)
        self.ledger.record(key, encoded)
        return value

    def _checkpoint_when_the_store_answers(self, key: Any, encoded: str) -> bool:
        """Store a checkpoint whose fn already ran, waiting in place for a store that went away.

        False: the fence refused it, this attempt no longer holds the run.

        The fn's effects have happened: giving up now would run it again on
        the next attempt. So the attempt keeps its slot and its message and
        tries again until the store answers, up to CHECKPOINT_WAIT seconds;
        only then does the run wait for the store like any other (re-sent).
        """
        tries = 0

        def store(conn: Connection) -> bool:
            nonlocal tries
            tries += 1
            try:
                return steps.insert(conn, self.run.id, key, encoded, self.token)
            except IntegrityError:
                if tries == 1:
                    raise
                # An earlier try's COMMIT landed while its reply was lost. The fence let this try
                # through, so the run is still this attempt's and no other attempt could have written
                # the key: the checkpoint is that earlier try's. Raised, it would fail the attempt and
                # spend a retry on a step that is done.
                return True

        return self.when_the_store_answers(store, "durable.step.checkpoint_failed")

    def when_the_store_answers(self, write: Callable[[Connection], T], event: str, *,
                               connection_lost: bool = False) -> T:
        """``write(conn)`` on this run's connection, tried again on a fresh one while the store is away.

        Up to CHECKPOINT_WAIT seconds, then the last StoreUnavailable is raised.
        ``connection_lost``: the current connection already failed, start on a
        fresh one. Each failure is reported to the outage tracker as ``event``.
        """
        deadline = time.monotonic() + CHECKPOINT_WAIT
        delay = 0.2
        fresh_connection = connection_lost
        while True:
            try:
                with unavailable_as_error(self.url):
                    if fresh_connection:
                        self._reconnect()
                    done = write(self.conn)
                outage.available(self.url)
                return done
            except StoreUnavailable as err:
                outage.failed(self.url, err, event, run_id=self.run.id)
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)  # the store's recovery, not a test: there is nothing to poll but it
                delay = min(delay * 2, 2.0)
                fresh_connection = True

    def _reconnect(self) -> None:
        # A fresh autocommit connection, never the invalidated one: SQLAlchemy
        # revalidates that one without its AUTOCOMMIT isolation level, so the
        # checkpoint and the run's outcome would sit in a transaction nobody
        # commits and vanish at close.
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001 - the old connection is dead: closing is only tidying
            pass
        # Raises (as StoreUnavailable, in the caller) while the store is still down.
        self.conn = autocommit(self.engine).connect()

    def sleep(self, name: Any, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
            raise ValueError(f"sleep {name!r}: seconds must be a number >= 0, got {seconds!r}")
        # The wake time is itself a step (whose key checks the name first): a redelivery
        # before it re-sleeps, one after returns.
        wake_at = self.step(name, _wake_time, (float(seconds),), {})
        remaining = wake_at - time.time()
        if remaining <= 0:
            return
        task, request = self.task, self.task.request
        if request.is_eager:
            # Eager (task_always_eager, .apply()): there is no worker to wake
            # it, and Celery runs an eager countdown at once; so does this
            # sleep. Re-sending would run the body again right here, sleeping
            # again, without end.
            logger.info("durable.sleep.eager name=%s id=%s: not waiting %.3fs (eager run)", name,
                        self.run.id, remaining,
                        extra={"event": "durable.sleep.eager", "run_id": self.run.id, "step": name})
            return

        # Same id, args and retries count: the sleep does not burn an attempt.
        # The wake-up carries this attempt's lease token: it alone resumes the
        # run; any other copy delivered meanwhile finds it sleeping and is dropped.
        headers = {**(getattr(request, "headers", None) or {}), RESUME_HEADER: self.token}
        task.signature_from_request(request, countdown=remaining, retries=request.retries,
                                    headers=headers).apply_async()
        try:
            with unavailable_as_error(self.url):
                marked_sleeping = runs.hand_off_to_sleep(
                    self.conn, self.run.id, self.token,
                    datetime.fromtimestamp(wake_at, timezone.utc))
        except StoreUnavailable as err:
            # The wake-up still carries the token the row names: it resumes the run all the same.
            outage.failed(self.url, err, "durable.sleep.hand_off_failed", run_id=self.run.id)
            marked_sleeping = False
        logger.debug("durable.sleep.handed_off id=%s marked_sleeping=%s", self.run.id, marked_sleeping,
                     extra={"event": "durable.sleep.handed_off", "run_id": self.run.id,
                            "marked_sleeping": marked_sleeping})
        raise SleepHandOff(name, remaining)


def _wake_time(seconds: float) -> float:
    return time.time() + seconds


_current: ContextVar[RunContext | None] = ContextVar("celery_durable_run", default=None)


def current() -> RunContext:
    ctx = _current.get()
    if ctx is None:
        raise NotDurable(
            "step() and sleep() only work inside a durable run: call them from an "
            "@app.durable_task body (or a function it calls) executed by a worker or .apply()"
        )
    return ctx


def step(name: str, fn: Callable[..., Any], *args: Any, transactional: bool = False, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` once per run: a checkpoint found returns its result instead.

    ``transactional=True`` calls ``fn(conn, *args, **kwargs)`` with a SQLAlchemy
    Connection in the transaction that stores the checkpoint.
    """
    # Checked before the context so the error is about the name, wherever it is called.
    check_step_name(name)
    return current().step(name, fn, args, kwargs, transactional)


def sleep(name: str, seconds: float) -> None:
    """A durable sleep: the run is re-sent with a countdown and this execution ends (frees its slot).

    The wake time is a checkpoint: a redelivery before it sleeps again, one
    after it carries on. In an eager run (``task_always_eager``, ``.apply()``)
    the sleep returns at once, as Celery runs an eager countdown at once: the
    body carries on in the caller, and the wake time is still recorded.
    """
    current().sleep(name, seconds)
