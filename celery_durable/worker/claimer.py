"""The claim loop: executes sweep plans, waits on every queue at once when idle, counts what it takes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from time import monotonic
from typing import Any

from kombu.messaging import Consumer as KombuConsumer

from celery_durable.compat.request import eta_ahead, waits_for_eta
from celery_durable.compat.transport_guards import guard_channel
from celery_durable.errors import InvariantBroken
from celery_durable.planning.claim_sweep import (
    Sweep,
    begin_sweep,
    next_ask,
    overdraw_after,
    overdrawn,
    record,
    skip_to,
    waitable_queues,
)
from celery_durable.planning.limits import BACK, RunRoom
from celery_durable.planning.ready_counts import ReadyCounts
from celery_durable.worker.fetchers import (
    Fetcher,
    PassFetcher,
    ProbingFetcher,
    fetcher_for,
    give_back_in_place,
    gives_back_in_place,
)
from celery_durable.worker.limit_gate import Admission, LimitGate
from celery_durable.worker.parking import POISON_POLICY, Parker, parker_for, undecodable
from celery_durable.worker.process_cap import HeldRun, HeldRuns
from celery_durable.worker.redis_idle_wait import RedisIdleWait

logger = logging.getLogger(__name__)

#: Seconds claiming pauses after the store could not answer the fleet-limit gate.
STORE_PAUSE = 1.0


class IdleChannels:
    """Channels for the idle any-queue wait, each reused once its messages are settled.

    The idle wait consumes with a prefetch of one over the whole channel, and a
    message can only be acked on the channel it came from: a channel still
    holding an unacked run (``acks_late``) would never deliver again, so a new
    wait takes a channel whose every message is settled, or opens one.
    """

    def __init__(self, connection: Any) -> None:
        self._connection = connection
        self._held: list[tuple[Any, list[Any]]] = []

    def take(self) -> tuple[Any, list[Any]]:
        for channel, messages in self._held:
            messages[:] = [m for m in messages if not m.acknowledged]
            if not messages:
                return channel, messages
        channel = guard_channel(self._connection.channel(), POISON_POLICY)
        # Global: one message across all of the wait's per-queue consumers.
        channel.basic_qos(0, 1, True)
        entry: tuple[Any, list[Any]] = (channel, [])
        self._held.append(entry)
        return entry

    def close(self) -> None:
        for channel, _ in self._held:
            try:
                channel.close()
            except Exception:  # noqa: BLE001 - closing on the way out; the broker requeues
                logger.debug("durable.idle.channel_close_failed", exc_info=True)
        self._held.clear()


class Claimer:
    """Fetches messages when the worker has room and hands them to Celery's task handler.

    Runs in the consumer's loop thread. ``kick()`` may be called from any
    thread; it coalesces into one pass on the loop thread.
    """

    def __init__(
        self,
        *,
        connection: Any,
        queues: Callable[[], Sequence[Any]],
        held: HeldRuns,
        accept: Any,
        schedule: Callable[[Callable[[], None]], None],
        stop_requested: Callable[[], bool] = lambda: False,
        before_pass: Callable[[], None] = lambda: None,
        new_fetcher: Callable[[Any, Any], Fetcher] = fetcher_for,
        gate: LimitGate | None = None,
        hub: Any = None,
    ) -> None:
        self._connection = connection
        self._hub = hub
        self._gate = gate
        self._queues = queues
        self.held = held
        self._accept = accept
        self._schedule = schedule
        self._stop_requested = stop_requested
        self._before_pass = before_pass
        self._new_fetcher = new_fetcher
        self.handler: Callable[[Any], Any] | None = None
        self.cursor: str | None = None
        self.running = False
        self._kick_pending = False
        self._kick_lock = threading.Lock()
        self._claim_channel: Any = None
        self._fetcher: Fetcher | None = None
        self._pass_fetcher: PassFetcher | None = None
        self._probing_fetcher: ProbingFetcher | None = None
        self._parker: Parker | None = None
        self._idle_channels = IdleChannels(connection)
        self._idle_consumers: list[Any] = []
        self._idle_channel_messages: list[Any] | None = None
        self._redis_wait: RedisIdleWait | None = None
        self._admitting: HeldRun | None = None
        self._ready = ReadyCounts()
        self.passes = 0
        #: Messages admitted from claim passes, and from the idle any-queue wait.
        self.claimed_by_passes = 0
        self.claimed_by_idle_wait = 0
        #: Messages a pass took that could have run but found no slot left: given back to the broker.
        self.handed_back = 0
        #: Messages the next pass takes beyond its room: grown while passes park or drop what they
        #: take (a flood of one busy key goes to the store in large batches), gone when they stop.
        self._overdraw = 0
        self._may_overdraw = False
        #: Set when the store could not answer the gate: no pass until then (a requeued
        #: message would otherwise come straight back and spin while the store is down).
        self._paused_until = 0.0

    # -- lifecycle -----------------------------------------------------------
    @property
    def claiming(self) -> bool:
        # A SIGTERM sets Celery's shutdown flag from the signal handler while a
        # pass may be mid-way: the next ask sees it, not only the next pass.
        return self.running and not self._stop_requested()

    def start(self) -> None:
        self._claim_channel = self._connection.channel()
        self._fetcher = self._new_fetcher(self._claim_channel, self._accept)
        # What the fetcher can do is asked once: an isinstance against a
        # runtime-checkable protocol walks its members (~3 % of a pass).
        self._pass_fetcher = self._fetcher if isinstance(self._fetcher, PassFetcher) else None
        self._probing_fetcher = self._fetcher if isinstance(self._fetcher, ProbingFetcher) else None
        self._parker = parker_for(self._connection, self._claim_channel)
        self._may_overdraw = gives_back_in_place(self._claim_channel)
        self._redis_wait = RedisIdleWait.for_channel(self._claim_channel, self._hub, self.kick)
        self.running = True
        # The first pass (and the idle wait it arms) runs now, before the worker
        # says ready, as stock Celery's consume does: a kick would queue it
        # beside asynloop's blocking 100 ms AMQP drain, which may go first.
        self._kicked()

    def stop(self) -> None:
        """Stop claiming now: a pass checks this between two asks."""
        self.running = False
        self._cancel_idle_wait()

    def close(self) -> None:
        self.stop()
        self._idle_channels.close()
        if self._redis_wait is not None:
            self._redis_wait.close()

    def queues_changed(self) -> None:
        """A queue was cancelled: the idle wait must not go on consuming what it was armed on.

        Called on the loop thread (remote control runs there), before the
        command replies: a message sent to a cancelled queue after the reply
        must stay in the broker. The pass this kicks re-arms on the queues now consumed.
        """
        self._cancel_idle_wait()
        self.kick()

    # -- wake-ups ------------------------------------------------------------
    def kick(self) -> None:
        """Ask for a pass soon; many kicks before it runs make one pass."""
        with self._kick_lock:
            if self._kick_pending:
                return
            self._kick_pending = True
        self._schedule(self._kicked)

    def _kicked(self) -> None:
        with self._kick_lock:
            self._kick_pending = False
        self.run_pass()

    # -- the pass --------------------------------------------------------------
    def run_pass(self) -> int:
        try:
            return self._claim()
        finally:
            if self._gate is not None:
                # The leases of runs that ended go back with the pass's take (one round
                # trip); the ones no take carried (a pass with no limited message) now.
                self._gate.give_back_ended()

    def _claim(self) -> int:
        if not self.claiming or self.handler is None or self._fetcher is None:
            return 0
        if monotonic() < self._paused_until:
            return 0  # the safety timer's next kick tries again
        # A wait still armed could deliver beside the pass's asks and overshoot
        # the room read below; cancelling it first may itself admit one
        # message, which is counted before the room is read.
        self._cancel_idle_wait()
        # Runs whose ETA fell due while the worker was full go before new claims.
        self._before_pass()
        queues = {queue.name: queue for queue in self._queues()}
        order = [name for name in self.held.queues() if name in queues]
        free = self.held.free_slots()
        room = self.held.room()
        # A pass that asks beyond its room must check each run against the slots as it admits it;
        # one that does not cannot take more than its room, and skips that bookkeeping.
        bounded = self._overdraw > 0 and room > 0
        free, room = overdrawn({q: free.get(q, 0) for q in order}, room, self._overdraw)
        if self._probing_fetcher is not None and room > 0:
            free = self._probed(self._probing_fetcher, free, self._ready)
        sweep = begin_sweep(order, free, room, self.cursor)
        self.passes += 1
        went_to_wait = handed_back = 0
        if self._pass_fetcher is not None and self.claiming:
            sweep, went_to_wait, handed_back = self._run_whole_pass(self._pass_fetcher, sweep, bounded)
        else:
            while self.claiming:
                ask, sweep = next_ask(sweep)
                if ask is None:
                    break
                taken, admitted, back = self._fetch(queues[ask.queue], ask.count, bounded)
                self._ready.took(ask.queue, ask.count, taken)
                sweep = record(sweep, ask, taken)
                went_to_wait += taken - admitted - back
                handed_back += back
        if self._may_overdraw:
            # Messages the store could not decide went back to the broker, not to wait: a pass paused
            # for the store takes no more than its room when it resumes (a larger one would only churn).
            store_down = monotonic() < self._paused_until
            self._overdraw = 0 if store_down else overdraw_after(went_to_wait, handed_back)
        if went_to_wait and not handed_back:
            # Messages parked (or gone to wait for a limit, or dropped) took room in this pass
            # without holding a slot; another pass fills it. Recording only the ones admitted would
            # read the queue as drained, and wait on it one delivery at a time. (A pass that gave
            # messages back ran out of slots: the runs that end kick the next.)
            self.kick()
        self.cursor = sweep.cursor
        self.claimed_by_passes += sweep.claimed
        if self.claiming and self.held.room() > 0 and not self._kick_pending:
            # Every queue with a free slot gave less than it was asked for: wait
            # on all of them at once instead of polling. Not while a kick is
            # pending (runs finished during the pass): that pass re-plans, and
            # arming now would cost a consume and a cancel for nothing.
            self._arm_idle_wait(queues)
        return sweep.claimed

    @staticmethod
    def _probed(fetcher: ProbingFetcher, free: dict[str, int], memory: ReadyCounts) -> dict[str, int]:
        """Free slots capped by each queue's ready messages, so a pass asks only queues with work.

        Worth its round trip only when two or more queues could be asked: an
        empty queue would otherwise cost an ask each. A young probe stands in
        for a new one (planning/ready_counts.py). A message arriving on a queue
        after it read empty is not lost: a later probe finds it, or the idle
        wait armed after a pass that found nothing.
        """
        open_queues = [q for q, slots in free.items() if slots > 0]
        if len(open_queues) < 2:
            return free
        started = monotonic()
        ready = memory.reusable(open_queues, started)
        if ready is None:
            ready = fetcher.ready_counts(open_queues)
            now = monotonic()
            memory.probed(ready, now, now - started)
        return {q: min(slots, ready.get(q, slots)) for q, slots in free.items()}

    def _run_whole_pass(self, fetcher: PassFetcher, sweep: Sweep, bounded: bool) -> tuple[Sweep, int, int]:
        """The pass in one broker round trip; the planner replays its asks and must agree with each.

        Returns the sweep, how many messages took no slot (parked, waiting, dropped) and how many
        went back to the broker for want of one.
        """
        results = fetcher.claim_pass(sweep.to_ask, sweep.free, sweep.room)
        unreadable = 0
        taken: list[tuple[str, Any]] = []
        for result in results:
            # The broker reports only the asks that took messages; the ones
            # between took nothing and leave the sweep as it was.
            ask, sweep = next_ask(skip_to(sweep, result.queue))
            if ask is None or (ask.queue, ask.count) != (result.queue, result.count):
                raise InvariantBroken(f"the broker's claim pass asked {result.queue!r} for {result.count}, "
                                      f"the planner {ask!r}")
            sweep = record(sweep, ask, result.taken)
            # A message already taken from the broker is admitted even if a stop
            # came meanwhile: it is counted, and the drain hands it back.
            taken.extend((result.queue, message) for message in result.messages)
            unreadable += result.taken - len(result.messages)
        # Admitted together: the limit gate decides a pass's limited messages in one store transaction.
        admitted, handed_back = self._admit_all(taken, bounded)
        return sweep, unreadable + len(taken) - admitted - handed_back, handed_back

    def _fetch(self, queue: Any, count: int, bounded: bool) -> tuple[int, int, int]:
        """(messages taken from the broker, of them admitted: now holding a slot, given back: no slot left)."""
        if self._fetcher is None:  # run_pass checked; set once at start, never cleared
            return 0, 0, 0
        # A message already taken from the broker is admitted even if a stop
        # came meanwhile: it is counted, and the drain hands it back.
        messages = list(self._fetcher.fetch(queue, count, lambda: self.claiming))
        admitted, handed_back = self._admit_all([(queue.name, message) for message in messages], bounded)
        return len(messages), admitted, handed_back

    def _admit(self, queue_name: str, message: Any) -> bool:
        """Hand ``message`` to Celery; False if it was parked, went to wait for a limit, or back (no slot)."""
        return self._admit_all([(queue_name, message)], bounded=False)[0] == 1

    def _admit_all(self, taken: list[tuple[str, Any]], bounded: bool) -> tuple[int, int]:
        """Hand each (queue, message) to Celery in order; ``bounded``: as far as the worker's slots go.

        Returns (how many now hold a slot, how many went back to the broker: they could run, but
        the pass took more than its room and none was left).
        """
        readable = []
        for queue_name, message in taken:
            reason = undecodable(message)
            if reason is not None:
                # Stock Celery acks (on_decode_error) or rejects (on_invalid_task)
                # such a message, and it is gone: parked, an operator can see it.
                self._park(queue_name, message, reason)
            else:
                readable.append((queue_name, message))
        admissions = self._admissions(readable, RunRoom(self.held.room(), self.held.free_slots()) if bounded else None)
        back = [message for (_, message), (_, admission) in zip(readable, admissions)
                if admission is not None and admission.verdict == BACK]
        admitted = sum(self._admit_readable(queue_name, message, checked, admission)
                       for (queue_name, message), (checked, admission) in zip(readable, admissions))
        if back:
            self._give_back_unstarted(back)
        return admitted, len(back)

    def _admissions(self, readable: list[tuple[str, Any]],
                    room: RunRoom | None) -> list[tuple[bool, Admission | None]]:
        """(checked, admission) per message: what runs, within ``room`` (None: everything taken fits).

        A message whose ETA is ahead holds no slot until due and is not checked
        now (it takes its leases when due). The rest spend the room in order,
        the runs of unlimited tasks first, then the fleet-limit gate's (one store
        transaction for them all); a message that could run once it is spent is BACK.
        """
        gate = self._gate
        ahead = [eta_ahead(message) for _, message in readable]
        out: list[tuple[bool, Admission | None]] = []
        limited_at: list[int] = []
        for (queue_name, message), later in zip(readable, ahead):
            if later:
                out.append((False, None))
            elif gate is not None and gate.decides(message):
                limited_at.append(len(out))
                out.append((True, None))  # the gate's answer replaces it below
            else:
                fits = room is None or room.take(queue_name)
                out.append((gate is not None, None if fits else Admission(BACK)))
        if gate is None or not limited_at:
            return out
        admissions, store_failed = gate.admit_or_hand_back([readable[i] for i in limited_at], room)
        if store_failed:
            self._paused_until = monotonic() + STORE_PAUSE
        for index, admission in zip(limited_at, admissions):
            if admission is None and room is not None and not room.take(readable[index][0]):
                # The gate could not read its arguments (Celery's strategy will park it): it would still
                # take a slot on its way there, and there is none left.
                admission = Admission(BACK)
            out[index] = (True, admission)
        return out

    def _give_back_unstarted(self, messages: list[Any]) -> None:
        """Messages that could run but found no slot go back to the broker, ahead of what came after them.

        They hold nothing (no slot, no lease, no rate turn) and burn no attempt.
        Only a pass that took more than its room has any, and only on a transport
        that puts them back in place (``fetchers.gives_back_in_place``).
        """
        self.handed_back += len(messages)
        give_back_in_place(messages)

    def _admit_readable(self, queue_name: str, message: Any, checked: bool, admission: Admission | None) -> bool:
        grant = None
        if admission is not None:  # not RUN (parked, dropped, failed or BACK) holds no slot
            if not admission.runs:
                return False
            grant = admission.grant
        run = self.held.take(queue_name, message)
        run.limit_grant, run.limit_checked = grant, checked
        self._admitting = run
        try:
            self._handle(message)
        except Exception as exc:
            if run.request is not None or message.acknowledged:
                # Past the content: the strategy made a request (or settled
                # the message) and the failure is the worker's, not the message's.
                raise
            # A body that decodes but that the strategy cannot read (args
            # that are not [args, kwargs, embed], a bad header): the content,
            # not the worker, is at fault.
            logger.warning("durable.message.unreadable queue=%s", queue_name, exc_info=True,
                           extra={"queue": queue_name})
            self._park(queue_name, message, f"the task handler raised {exc!r}")
            return False
        finally:
            self._admitting = None
            if run.request is None:
                # The strategy dropped it (revoked, expired, unknown task, bad
                # payload): nothing will run, so the count goes back now.
                self.held.give_back(message)
            elif waits_for_eta(run.request, in_pool=run.in_pool):
                # Waiting for its ETA: it frees its slot until it is due.
                self.held.schedule(message)
        return True

    def _park(self, queue_name: str, message: Any, reason: str) -> None:
        if self._parker is None:
            raise RuntimeError("the claimer parks messages only once started")
        self._parker.park(queue_name, message, reason)

    def _handle(self, message: Any) -> None:
        if self.handler is None:
            raise RuntimeError("the claimer was started before Celery gave it the task handler")
        self.handler(message)

    def bind_request(self, request: Any) -> None:
        """Called as the strategy makes a request for the message being admitted."""
        run = self._admitting
        if run is not None and request.message is run.message:
            run.request = request

    @property
    def round_trips(self) -> int:
        """Broker round trips the claim passes made (the idle wait's deliveries not included)."""
        return self._fetcher.round_trips if self._fetcher is not None else 0

    # -- the idle wait -----------------------------------------------------------
    def idle_waiting_on(self) -> set[str]:
        """The queues the idle any-queue wait is armed on (empty when it is not armed)."""
        peeked = self._redis_wait.waiting_on if self._redis_wait is not None else set()
        return peeked | {queue.name for consumer in self._idle_consumers for queue in consumer.queues}

    @property
    def idle_wakes(self) -> int:
        """Times the Redis idle wait saw a message and kicked a pass (the pass took it, or another worker did)."""
        return self._redis_wait.wakes if self._redis_wait is not None else 0

    def _arm_idle_wait(self, queues: dict[str, Any]) -> None:
        names = waitable_queues(self.held.queues(), self.held.free_slots(), self.held.room())
        names = tuple(name for name in names if name in queues)
        # On Redis the wait only watches (worker/redis_idle_wait.py); elsewhere, on a Redis without
        # BLMOVE, and past its connection budget, kombu's consumer delivers (RabbitMQ keeps an
        # unacked delivery; Redis's BRPOP keeps its gap).
        if self._redis_wait is not None and self._redis_wait.arm(names):
            return
        if not names or self._idle_consumers:
            return
        channel, messages = self._idle_channels.take()
        self._idle_channel_messages = messages
        for name in names:
            consumer = KombuConsumer(
                channel,
                queues=[queues[name]],
                accept=self._accept,
                on_message=self._idle_delivery(name, messages),
                auto_declare=False,
            )
            consumer.consume()
            self._idle_consumers.append(consumer)

    def _idle_delivery(self, queue_name: str, messages: list[Any]) -> Callable[[Any], None]:
        def on_message(message: Any) -> None:
            messages.append(message)
            self.cursor = queue_name
            self.claimed_by_idle_wait += 1
            # Admitted before the wait is cancelled (a synchronous round trip on
            # AMQP): the wait's channel has a prefetch of one, so nothing else
            # can arrive on it meanwhile.
            self._admit(queue_name, message)
            self._cancel_idle_wait()
            # One message woke us: fill the rest of the room with planned asks.
            self.kick()

        return on_message

    def _cancel_idle_wait(self) -> None:
        if self._redis_wait is not None:
            self._redis_wait.disarm()
        consumers, self._idle_consumers = self._idle_consumers, []
        for consumer in consumers:
            try:
                consumer.cancel()
            except Exception:  # noqa: BLE001 - a dead channel has nothing left to cancel
                logger.debug("durable.idle.cancel_failed", exc_info=True)

