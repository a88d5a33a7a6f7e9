"""The fleet-limit gate: a claimed message of a limited task takes its leases before it takes a slot.

Called by the claimer for each message it is about to admit (and for an
ETA message when it falls due). A message of a task with no declared limit
costs a dict lookup. For a limited one the store answers in one transaction
per claim pass (``store.limits.take_batch``): every lease taken (the run goes
on to Celery, holding them until its count is given back), or a scope busy
(the message is parked whole in the store and acked, or acked and dropped),
or a rate turn later than now (parked until then). A parked message holds no
slot, burns no attempt and costs no broker traffic while it waits; the
dispatcher (``limits/dispatcher.py``) publishes it again, unchanged, when its
turn comes. The gate wakes it through ``wake``, and keeps the returns the
store refused for it to try again: it never names the dispatcher.

On PostgreSQL the common case costs one statement (``store.limits.exchange``):
the leases of the runs that ended since the last pass go back and the pass's
runs take theirs, when every scope has room and nobody waits there; anything
else falls to the general transaction.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery_durable.clock import SYSTEM_CLOCK, Clock
from celery_durable.compat.host_types import HostMessage
from celery_durable.headers import KEY_HEADER, TASK_ID_HEADER, TASK_NAME_HEADER, WHEN_BUSY_HEADER
from celery_durable.leases.keeper import keeper, new_token
from celery_durable.limits.declarations import Declarations
from celery_durable.limits.messages import ack, ack_all, arguments, parked
from celery_durable.metrics import jobs
from celery_durable.metrics import limits as limit_metrics
from celery_durable.planning.limit_declarations import KeyFunctionFailed, Scope, TaskLimits
from celery_durable.planning.limits import BACK, DROP, FAIL, RUN, WAIT, Decision, LimitAsk, RunRoom
from celery_durable.store import limits as store
from celery_durable.store import outage
from celery_durable.store.clock import StoreClock
from celery_durable.store.engine import autocommit, engine_for, ensure_schema, unavailable_as_error

logger = logging.getLogger("celery_durable.limits")

#: Seconds a scope found busy by the general transaction is assumed still busy (see ``_busy_until``).
BUSY_MEMORY = 0.25


@dataclass
class Grant:
    """The leases one admitted run holds, given back when its count is."""

    task_id: str
    scopes: tuple[Scope, ...]
    limits: TaskLimits
    holds_rate_turn: bool

    @property
    def task(self) -> str:
        return self.limits.task


@dataclass(frozen=True)
class Admission:
    """The gate's answer for one message: RUN (with its grant), settled here (WAIT, DROP, FAIL), or
    BACK (it could run but the pass had no slot left: the claimer gives it back to the broker)."""

    verdict: str
    grant: Grant | None = None

    @property
    def runs(self) -> bool:
        return self.verdict == RUN


class LimitGate:
    """Takes and gives back the fleet-limit leases of one worker's runs."""

    def __init__(self, app: Any, limits: Mapping[str, TaskLimits], *, url: str, lease_ttl: float,
                 wake: Callable[[], None] = lambda: None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.app = app
        self.limits = dict(limits)
        self.url = url
        self.lease_ttl = lease_ttl
        #: This worker process: every lease it takes names it, so one statement renews them all.
        self.holder = new_token()
        self._clock = clock
        #: Leases and rate turns are written and compared in the store's time (store/clock.py).
        self._store_clock = StoreClock(engine_for(url), clock)
        self._grants: dict[str, Grant] = {}
        self._lock = threading.Lock()
        #: Tells the dispatcher that parked messages are due (made ready, or booked a rate turn).
        self._wake = wake
        self.waited = 0
        self.dropped = 0
        #: PostgreSQL: a claim pass's runs take their leases, and the ended runs' go back, in one statement
        #: (known once :meth:`open` has seen the store).
        self._fast_path = False
        #: Fast path: leases of runs that ended, given back with the next claim pass's take.
        self._ended: list[store.Return] = []
        #: Scopes the general transaction just found busy, until when they are assumed still busy: a
        #: batch touching one skips the fast path, which could only answer "not here" (a flood on one key).
        self._busy_until: dict[Scope, float] = {}
        self._declarations = Declarations(self.holder, self.limits, lease_ttl)
        #: Returns the store refused: the dispatcher tries them again each round (the heartbeat renews every
        #: lease this worker holds, so a lease not given back would never expire).
        self._refused: deque[store.Return] = deque()
        self._closed = False

    def open(self) -> None:
        """Before the first claim: this worker's leases are renewed from now, its limits declared and reported."""
        self._fast_path = ensure_schema(self.url).dialect.name == "postgresql"
        keeper().hold_limits(self.url, self.holder, self.lease_ttl)
        try:
            with unavailable_as_error(self.url), engine_for(self.url).begin() as conn:
                self.declare(conn)
        except Exception as err:  # noqa: BLE001 - the dispatcher declares again at each sweep
            logger.warning("durable.limit.declare_failed error=%s: declared again at the dispatcher's next sweep",
                           err, extra={"event": "durable.limit.declare_failed", "error": repr(err)})
        limit_metrics.watch(self.url, tuple(self.limits))

    # -- admission -----------------------------------------------------------------------
    def decides(self, message: HostMessage) -> bool:
        """Whether ``message``'s task declares a fleet limit (the store decides whether it runs)."""
        return str((message.headers or {}).get(TASK_NAME_HEADER)) in self.limits

    def admit_or_hand_back(self, items: list[tuple[str, HostMessage]],
                           room: RunRoom | None = None) -> tuple[list[Admission | None], bool]:
        """:meth:`admit_batch`, and when the store cannot answer, every limited message back to the broker.

        Returns the admissions and whether the store failed (the caller pauses
        claiming: a requeued message would come straight back). A message is
        never run unchecked and never held waiting in memory for the store.
        """
        try:
            return self.admit_batch(items, room), False
        except Exception as err:  # noqa: BLE001 - the store did not answer: the broker keeps the messages
            outage.failed(self.url, err, "durable.limit.store_unavailable", level=logging.WARNING,
                          then="limited messages go back to the broker")
        out: list[Admission | None] = []
        for _, message in items:
            if message.acknowledged:
                out.append(Admission(FAIL))  # settled before the store was asked (its key function failed)
            elif self.decides(message):
                message.reject(requeue=True)
                out.append(Admission(WAIT))
            else:
                out.append(None)
        return out, True

    def admit_batch(self, items: list[tuple[str, HostMessage]], room: RunRoom | None = None) -> list[Admission | None]:
        """For each (queue, message): None when its task declares no limit, else what the store decided,
        already acted on (parked or dropped messages acked); one store transaction for all the limited ones.

        ``room``: the slots the runs may take (spent here); a message that could run when it is spent
        is BACK, holding nothing: the caller gives it back to the broker. None: every run fits.
        """
        out: list[Admission | None] = [None] * len(items)
        asks: list[tuple[int, LimitAsk, TaskLimits]] = []
        for index, (queue, message) in enumerate(items):
            headers = message.headers or {}
            limits = self.limits.get(str(headers.get(TASK_NAME_HEADER)))
            if limits is None:
                continue
            task_id = str(headers.get(TASK_ID_HEADER))
            try:
                args, kwargs = arguments(message)
            except Exception:  # noqa: BLE001 - a body Celery cannot read either: its strategy parks it
                continue
            try:
                scopes = limits.scopes(args, kwargs, headers.get(KEY_HEADER))
                when_busy = limits.when_busy_of(headers.get(WHEN_BUSY_HEADER))
            except KeyFunctionFailed as err:
                self._fail(limits.task, task_id, queue, message, err)
                out[index] = Admission(FAIL)
                continue
            asks.append((index, LimitAsk(limits.task, task_id, scopes, limits.rate, when_busy, queue), limits))
        if not asks:
            return out
        if self._took_at_once([ask for _, ask, _ in asks], room):
            for index, ask, limits in asks:
                out[index] = self._act(items[index][0], ask, limits, Decision(RUN))
            return out
        self.give_back_ended()  # the general transaction below must see the room they leave
        kept = [parked(items[index][0], ask.task_id, items[index][1]) for index, ask, _ in asks]
        with unavailable_as_error(self.url), engine_for(self.url).begin() as conn:
            decisions, made_ready = store.take_batch(conn, [ask for _, ask, _ in asks], kept, holder=self.holder,
                                                     ttl=self.lease_ttl, now=self.now_in(conn), room=room)
        outage.available(self.url)
        wake = made_ready > 0
        self._remember_busy([decision.busy for decision in decisions if decision.busy is not None])
        settled: list[Any] = []
        for (index, ask, limits), decision in zip(asks, decisions):
            queue, message = items[index]
            out[index] = self._act(queue, ask, limits, decision)
            if decision.verdict in (WAIT, DROP):
                settled.append(message)
            wake = wake or decision.publish_at is not None
        # Parked or dropped: the store has them (or they are done with); the broker lets them go.
        ack_all(settled)
        if wake:
            self._wake()
        return out

    def _took_at_once(self, asks: list[LimitAsk], room: RunRoom | None) -> bool:
        """The common case in one round trip (PostgreSQL): runs whose scopes have room for them all
        and no waiters, and that all fit the pass's slots, take their leases, after the ended runs'
        leases went back in the same call. False: nothing taken, the general transaction decides."""
        if (not self._fast_path or any(ask.rate is not None or not ask.scopes for ask in asks)
                or len({ask.task_id for ask in asks}) != len(asks)
                or (room is not None and not room.fits([ask.queue for ask in asks]))):
            return False
        now = self._clock.monotonic()
        if any(self._busy_until.get(scope, 0.0) > now for ask in asks for scope in ask.scopes):
            return False  # the general path gives the ended runs' leases back first (give_back_ended)
        if not self._exchange(asks):
            return False
        if room is not None:
            for ask in asks:
                room.take(ask.queue)
        return True

    def _exchange(self, asks: list[LimitAsk]) -> bool:
        with self._lock:
            returns, self._ended = self._ended, []
        try:
            with unavailable_as_error(self.url), autocommit(engine_for(self.url)).connect() as conn:
                taken, waiters = store.exchange(conn, returns, asks, holder=self.holder, ttl=self.lease_ttl,
                                                now=self.now_in(conn))
        except Exception:
            with self._lock:
                self._ended[:0] = returns  # not given back: the next call (or the dispatcher's round) tries
            raise
        outage.available(self.url)
        if waiters:
            self.give_back_now(returns)  # the general release makes the waiters ready
        return taken

    def _remember_busy(self, scopes: list[Scope]) -> None:
        now = self._clock.monotonic()
        if len(self._busy_until) > 1000:
            self._busy_until = {scope: until for scope, until in self._busy_until.items() if until > now}
        for scope in scopes:
            self._busy_until[scope] = now + BUSY_MEMORY

    def give_back_ended(self) -> None:
        """Give back the leases of runs that ended since the last claim pass (PostgreSQL).

        A pass that takes leases gives these back in its own call; the claimer
        calls this after every pass, and the dispatcher at each round, for the
        ones no take carried.
        """
        if not self._ended:
            return
        try:
            self._exchange([])
        except Exception as err:  # noqa: BLE001 - kept, and tried again: the heartbeat would keep them held
            outage.failed(self.url, err, "durable.limit.release_failed", level=logging.WARNING,
                          then="tried again at the next claim pass")

    def _act(self, queue: str, ask: LimitAsk, limits: TaskLimits, decision: Decision) -> Admission:
        if decision.verdict == RUN:
            grant = Grant(ask.task_id, ask.scopes, limits, decision.holds_rate_turn)
            with self._lock:
                self._grants[ask.task_id] = grant
            return Admission(RUN, grant)
        if decision.verdict == DROP:
            self.dropped += 1
            jobs.count(queue, "dropped")
            logger.info("durable.limit.dropped task=%s id=%s key=%s: busy, and the task drops when busy",
                        ask.task, ask.task_id, decision.busy.key if decision.busy else "",
                        extra={"event": "durable.limit.dropped", "task": ask.task, "task_id": ask.task_id,
                               "key": decision.busy.key if decision.busy else ""})
            return Admission(DROP)
        if decision.verdict == BACK:
            return Admission(BACK)
        self.waited += 1
        return Admission(WAIT)

    def release(self, grant: Grant, *, started: bool) -> None:
        """Give ``grant``'s leases back (a run that never started, its rate turn too).

        Called wherever a run's count goes back, before that count can be
        claimed again: a slot the worker frees is free in the store first (given
        back later, the next claim would find the scope full and wait for nothing).
        """
        with self._lock:
            if self._grants.get(grant.task_id) is grant:
                del self._grants[grant.task_id]
        give_back_turn = grant.limits.rate if grant.holds_rate_turn and not started else None
        if not grant.scopes and give_back_turn is None:
            return
        for scope in grant.scopes:
            self._busy_until.pop(scope, None)  # a lease of it comes free: the fast path may take it
        returned = store.Return(grant.task, grant.task_id, grant.scopes, give_back_turn)
        if self._fast_path and give_back_turn is None:
            # Carried by the claim pass this slot's freeing kicks: its take and this
            # give-back are one round trip, the give-back first.
            with self._lock:
                self._ended.append(returned)
            return
        self.give_back_now([returned])

    def give_back_now(self, returns: list[store.Return]) -> None:
        """The general store transaction of :meth:`release`, for several returns at once."""
        try:
            with unavailable_as_error(self.url), engine_for(self.url).begin() as conn:
                made_ready = store.release(conn, returns, holder=self.holder, ttl=self.lease_ttl, now=self.now_in(conn))
        except Exception as err:  # noqa: BLE001 - reported, and tried again: the heartbeat would keep them held
            outage.failed(self.url, err, "durable.limit.release_failed", level=logging.WARNING,
                          then="their leases expire one TTL after their last renewal" if self._closed else
                          "tried again at the dispatcher's next round", ids=",".join(r.task_id for r in returns))
            if not self._closed:
                self._refused.extendleft(reversed(returns))
            return
        outage.available(self.url)
        if made_ready:
            self._wake()

    def give_back_refused(self) -> None:
        """Try again the returns the store refused (the dispatcher, each round and when it stops)."""
        returns = []
        while True:
            try:
                returns.append(self._refused.popleft())
            except IndexError:
                break
        if returns:
            self.give_back_now(returns)

    def held(self) -> dict[str, dict[str, int]]:
        """Leases this worker holds, per task and key (``*`` for the task-wide concurrency)."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            grants = list(self._grants.values())
        for grant in grants:
            for scope in grant.scopes:
                per_key = out.setdefault(scope.task, {})
                name = scope.key if scope.kind == "key" else "*"
                per_key[name] = per_key.get(name, 0) + 1
        return out

    def now(self) -> datetime:
        """Now in the store's clock, outside a transaction (a connection only to read it again)."""
        return self._store_clock.now()

    def now_in(self, conn: Any) -> datetime:
        """Now in the store's clock, read on ``conn`` when it is due for reading (no second connection)."""
        return self._store_clock.now_in(conn)

    def close(self) -> None:
        """The worker is leaving: what it still holds goes back, so waiters need not wait out a TTL."""
        self._closed = True
        keeper().release_limits(self.url, self.holder)
        limit_metrics.unwatch(self.url)
        with self._lock:
            self._ended.clear()  # every lease of this holder goes below
        self._refused.clear()
        try:
            with unavailable_as_error(self.url), engine_for(self.url).begin() as conn:
                store.release_holder(conn, self.holder)
                store.sweep(conn, self.scope_limits(), self.lease_ttl, self.now_in(conn))
        except Exception as err:  # noqa: BLE001 - the leases expire one TTL after the last renewal
            outage.failed(self.url, err, "durable.limit.close_failed", level=logging.WARNING,
                          then="its leases expire one TTL after their last renewal")

    def declare(self, conn: Any) -> None:
        """Write this worker's limits to the store (see ``limits/declarations.py``)."""
        self._declarations.declare(conn, self.now_in(conn))

    def scope_limits(self) -> dict[tuple[str, str], int]:
        return self._declarations.mine

    # -- a run that cannot run --------------------------------------------------------------
    def _fail(self, task_name: str, task_id: str, queue: str, message: HostMessage, err: KeyFunctionFailed) -> None:
        # Settled failed, as a task that raised: the result backend has the error, the message goes.
        logger.error("durable.limit.key_failed id=%s: %s", task_id, err,
                     extra={"event": "durable.limit.key_failed", "task_id": task_id})
        task = self.app.tasks.get(task_name)
        if task is not None and not getattr(task, "ignore_result", False):
            try:
                task.backend.mark_as_failure(task_id, err)
            except NotImplementedError:
                pass  # no result backend configured: the log line and the counter say it
        jobs.count(queue, "failed")
        ack(message)
