"""The fleet-limit gate: a claimed message of a limited task takes its leases before it takes a slot.

Called by the claimer for each message it is about to admit (and for an
ETA message when it falls due). A message of a task with no declared limit
costs a dict lookup. For a limited one the store answers in one transaction
per claim pass (``store.limits.take_batch``): every lease taken (the run goes
on to Celery, holding them until its count is given back), or a scope busy
(the message is parked whole in the store and acked, or acked and dropped),
or a rate turn later than now (parked until then). A parked message holds no
slot, burns no attempt and costs no broker traffic while it waits;
:class:`LimitDispatcher` publishes it again, unchanged, when its turn comes.

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
from time import monotonic, time
from typing import Any

from kombu.utils import json as kombu_json

from celery_durable.compat.redis_claim import ack_many
from celery_durable.headers import (
    KEY_HEADER,
    LIMITS_CHANNEL,
    SENT_AT_HEADER,
    TASK_ID_HEADER,
    TASK_NAME_HEADER,
    WHEN_BUSY_HEADER,
)
from celery_durable.leases.keeper import keeper, new_token
from celery_durable.metrics import jobs
from celery_durable.metrics import limits as limit_metrics
from celery_durable.planning.limit_declarations import (
    CONCURRENCY,
    KEY_LIMIT,
    TASK_SCOPE,
    KeyFunctionFailed,
    Scope,
    TaskLimits,
)
from celery_durable.planning.limits import BACK, DROP, FAIL, RUN, WAIT, Decision, LimitAsk, RunRoom
from celery_durable.store import limits as store
from celery_durable.store.clock import engine_now, store_now
from celery_durable.store.engine import autocommit, engine_for, ensure_schema, unavailable_as_error
from celery_durable.store.notify import Waker
from celery_durable.tasks import store_outage as outage

logger = logging.getLogger("celery_durable.limits")

#: Seconds a scope found busy by the general transaction is assumed still busy (see ``_busy_until``).
BUSY_MEMORY = 0.25

#: Message properties a parked message keeps (the rest are the broker's, per delivery).
_KEPT_PROPERTIES = ("priority", "correlation_id", "reply_to", "delivery_mode")


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
                 clock: Callable[[], datetime] | None = None) -> None:
        self.app = app
        self.limits = dict(limits)
        self.url = url
        self.lease_ttl = lease_ttl
        #: This worker process: every lease it takes names it, so one statement renews them all.
        self.holder = new_token()
        #: Leases and rate turns are written and compared in the store's clock (store/clock.py) unless a
        #: test gives a clock of its own.
        self._clock = clock
        self._grants: dict[str, Grant] = {}
        self._lock = threading.Lock()
        self.dispatcher: LimitDispatcher | None = None
        self.waited = 0
        self.dropped = 0
        #: PostgreSQL: a claim pass's runs take their leases, and the ended runs' go back, in one statement.
        self._fast_path = ensure_schema(url).dialect.name == "postgresql"
        #: Fast path: leases of runs that ended, given back with the next claim pass's take.
        self._ended: list[store.Return] = []
        #: Scopes the general transaction just found busy, until when they are assumed still busy: a
        #: batch touching one skips the fast path, which could only answer "not here" (a flood on one key).
        self._busy_until: dict[Scope, float] = {}
        #: (task, kind) pairs whose differing declarations this worker has already logged.
        self._differ_logged: set[tuple[str, str]] = set()
        keeper().hold_limits(url, self.holder, lease_ttl)
        try:
            with unavailable_as_error(url), engine_for(url).begin() as conn:
                self.declare(conn)
        except Exception as err:  # noqa: BLE001 - the dispatcher declares again at each sweep
            logger.warning("durable.limit.declare_failed error=%s: declared again at the dispatcher's next sweep",
                           err, extra={"event": "durable.limit.declare_failed", "error": repr(err)})
        limit_metrics.watch(url, tuple(self.limits))

    # -- admission -----------------------------------------------------------------------
    def decides(self, message: Any) -> bool:
        """Whether ``message``'s task declares a fleet limit (the store decides whether it runs)."""
        return str((message.headers or {}).get(TASK_NAME_HEADER)) in self.limits

    def admit_or_hand_back(self, items: list[tuple[str, Any]],
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

    def admit_batch(self, items: list[tuple[str, Any]], room: RunRoom | None = None) -> list[Admission | None]:
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
                args, kwargs = _arguments(message)
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
        parked = [_parked(items[index][0], ask.task_id, items[index][1]) for index, ask, _ in asks]
        with unavailable_as_error(self.url), engine_for(self.url).begin() as conn:
            decisions, made_ready = store.take_batch(conn, [ask for _, ask, _ in asks], parked, holder=self.holder,
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
        _ack_all(settled)
        if wake:
            self.wake_dispatcher()
        return out

    def _took_at_once(self, asks: list[LimitAsk], room: RunRoom | None) -> bool:
        """The common case in one round trip (PostgreSQL): runs whose scopes have room for them all
        and no waiters, and that all fit the pass's slots, take their leases, after the ended runs'
        leases went back in the same call. False: nothing taken, the general transaction decides."""
        if (not self._fast_path or any(ask.rate is not None or not ask.scopes for ask in asks)
                or len({ask.task_id for ask in asks}) != len(asks)
                or (room is not None and not room.fits([ask.queue for ask in asks]))):
            return False
        now = monotonic()
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
        now = monotonic()
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
            retry = self.dispatcher is not None and self.dispatcher.running
            outage.failed(self.url, err, "durable.limit.release_failed", level=logging.WARNING,
                          then="tried again at the dispatcher's next round" if retry else
                          "the leases are held until this worker stops", ids=",".join(r.task_id for r in returns))
            if retry and self.dispatcher is not None:
                self.dispatcher.give_back_later(returns)
            return
        outage.available(self.url)
        if made_ready:
            self.wake_dispatcher()

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
        return self._clock() if self._clock is not None else engine_now(engine_for(self.url))

    def now_in(self, conn: Any) -> datetime:
        """Now in the store's clock, read on ``conn`` when it is due for reading (no second connection)."""
        return self._clock() if self._clock is not None else store_now(conn)

    def wake_dispatcher(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.wake()

    def close(self) -> None:
        """The worker is leaving: what it still holds goes back, so waiters need not wait out a TTL."""
        keeper().release_limits(self.url, self.holder)
        limit_metrics.unwatch(self.url)
        with self._lock:
            self._ended.clear()  # every lease of this holder goes below
        try:
            with unavailable_as_error(self.url), engine_for(self.url).begin() as conn:
                store.release_holder(conn, self.holder)
                store.sweep(conn, self.scope_limits(), self.lease_ttl, self.now_in(conn))
        except Exception as err:  # noqa: BLE001 - the leases expire one TTL after the last renewal
            outage.failed(self.url, err, "durable.limit.close_failed", level=logging.WARNING,
                          then="its leases expire one TTL after their last renewal")

    def declare(self, conn: Any) -> None:
        """Write this worker's limits to the store (the lowest live one applies fleet-wide); log, once per
        task and option, any other worker declaring another value (a rolling deploy changing a limit)."""
        mine = self.scope_limits()
        declared = store.declare(conn, self.holder, mine, self.lease_ttl, self.now_in(conn))
        for pair, (lowest, highest) in declared.items():
            if lowest == highest or pair in self._differ_logged:
                continue
            self._differ_logged.add(pair)
            task, kind = pair
            other = highest if mine[pair] == lowest else lowest
            option = CONCURRENCY if kind == TASK_SCOPE else KEY_LIMIT
            logger.warning("durable.limit.declarations_differ task=%s option=%s this worker=%s another=%s: "
                           "the lowest, %s, applies across the fleet", task, option, mine[pair], other, lowest,
                           extra={"event": "durable.limit.declarations_differ", "task": task, "option": option,
                                  "declared": mine[pair], "other": other, "applied": lowest})

    def scope_limits(self) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        for name, limits in self.limits.items():
            if limits.concurrency is not None:
                out[(name, "task")] = limits.concurrency
            if limits.key is not None:
                out[(name, "key")] = limits.key_limit
        return out

    # -- a run that cannot run --------------------------------------------------------------
    def _fail(self, task_name: str, task_id: str, queue: str, message: Any, err: KeyFunctionFailed) -> None:
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
        _ack(message)


class LimitDispatcher:
    """Publishes parked messages whose turn came, and reclaims leases whose holder died; one thread per worker.

    Woken at once by this worker's own releases, by a NOTIFY from any
    worker's (PostgreSQL), and otherwise polls every ``poll_interval``; a
    message booked for a rate turn is published when that turn is due.
    """

    def __init__(self, gate: LimitGate, *, poll_interval: float, batch_size: int = 100) -> None:
        self.gate = gate
        self.poll_interval = poll_interval
        self.batch_size = batch_size
        self.published = 0
        self._stopping = threading.Event()
        self._returns: deque[store.Return] = deque()
        engine = engine_for(gate.url)
        self._waker = Waker(engine if engine.dialect.name == "postgresql" else None, LIMITS_CHANNEL,
                            report=self._listened)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once: a reconnecting consumer calls this again)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="durable-limit-dispatcher", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def wake(self) -> None:
        self._waker.wake()

    def give_back_later(self, returns: list[store.Return]) -> None:
        """Returns the store refused: tried again at each round until it takes them (the heartbeat
        renews every lease this worker holds, so a lease not given back would never expire)."""
        self._returns.extendleft(reversed(returns))

    def stop(self) -> None:
        self._stopping.set()
        self._waker.wake()
        if self._thread is not None:
            self._thread.join(10.0)
        self._give_back_queued()

    def _give_back_queued(self) -> None:
        returns = []
        while True:
            try:
                returns.append(self._returns.popleft())
            except IndexError:
                break
        if returns:
            self.gate.give_back_now(returns)

    def _run(self) -> None:
        next_sweep = 0.0
        try:
            while not self._stopping.is_set():
                self._waker.clear()
                delay = self.poll_interval
                try:
                    self.gate.give_back_ended()
                    self._give_back_queued()
                    now = self.gate.now()
                    if now.timestamp() >= next_sweep:
                        with engine_for(self.gate.url).begin() as conn:
                            # Declared again each sweep: a worker's declarations outlive a store outage
                            # that let them expire, and a new worker's differing one is noticed here.
                            self.gate.declare(conn)
                            store.sweep(conn, self.gate.scope_limits(), self.gate.lease_ttl, now)
                        next_sweep = now.timestamp() + min(self.poll_interval, self.gate.lease_ttl / 3.0)
                    more = self.publish_ready()
                    if more:
                        continue
                    with engine_for(self.gate.url).connect() as conn:
                        due = store.next_publish_at(conn)
                    if due is not None:
                        delay = min(delay, max((due - self.gate.now()).total_seconds(), 0.0))
                except Exception as err:  # noqa: BLE001 - the store or broker is down: the rows stay, try again
                    outage.failed(self.gate.url, err, "durable.limit.dispatch_failed", level=logging.WARNING)
                else:
                    outage.available(self.gate.url)
                if delay > 0:
                    self._waker.wait(delay)
        finally:
            self._waker.close()

    def _listened(self, err: BaseException | None) -> None:
        # Its own LISTEN (on the limits channel, for other workers' releases), not the outbox relay's.
        if err is None:
            outage.available(self.gate.url)
        else:
            outage.failed(self.gate.url, err, "durable.limit.listen_failed", level=logging.WARNING)

    def publish_ready(self) -> bool:
        """Publish one batch of due parked messages; True if the batch was full (more may be due)."""
        with engine_for(self.gate.url).begin() as conn:
            ready = store.claim_ready(conn, self.batch_size, self.gate.now_in(conn))
            if not ready:
                return False
            with self.gate.app.producer_or_acquire() as producer:
                for row in ready:
                    kept = row.message
                    # Ready again from now: the queue gauges' age counts from this send, not the first.
                    headers = {**kombu_json.loads(kept.headers), SENT_AT_HEADER: time()}
                    producer.publish(
                        kept.body, exchange=kept.exchange, routing_key=kept.routing_key,
                        headers=headers, content_type=kept.content_type,
                        content_encoding=kept.content_encoding, serializer=None, retry=True,
                        **kombu_json.loads(kept.properties),
                    )
            # Published, then forgotten in the same transaction: a crash between the two publishes
            # the message again (at least once), never loses it.
            store.forget(conn, [row.id for row in ready])
        self.published += len(ready)
        return len(ready) == self.batch_size


def _ack(message: Any) -> None:
    if not message.acknowledged:
        message.ack()


def _ack_all(messages: list[Any]) -> None:
    """Ack ``messages``: Redis ones of one channel in one round trip, others one by one."""
    pending = [message for message in messages if not message.acknowledged]
    by_channel: dict[int, list[Any]] = {}
    for message in pending:
        by_channel.setdefault(id(message.channel), []).append(message)
    for group in by_channel.values():
        if group[0].channel.connection.client.transport.driver_type == "redis":
            ack_many(group)
        else:
            for message in group:
                message.ack()


def _arguments(message: Any) -> tuple[Any, Any]:
    payload = message.decode()
    if isinstance(payload, dict):  # task protocol 1
        return payload.get("args") or (), payload.get("kwargs") or {}
    args, kwargs = payload[0], payload[1]
    return args or (), kwargs or {}


def _parked(queue: str, task_id: str, message: Any) -> store.WaitingMessage:
    delivery = message.delivery_info or {}
    properties = message.properties or {}
    body = message.body
    if isinstance(body, str):
        body = body.encode(message.content_encoding or "utf-8")
    return store.WaitingMessage(
        task_id=task_id,
        queue=queue,
        exchange=delivery.get("exchange") or "",
        routing_key=delivery.get("routing_key") or queue,
        body=bytes(body),
        headers=kombu_json.dumps(message.headers or {}),
        properties=kombu_json.dumps({k: properties[k] for k in _KEPT_PROPERTIES if properties.get(k) is not None}),
        content_type=message.content_type or "application/json",
        content_encoding=message.content_encoding or "utf-8",
    )
