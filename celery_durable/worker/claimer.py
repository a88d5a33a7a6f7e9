"""The claim loop: each pass plans its asks, fetches them and records what they took; idle, it waits on all queues."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from celery_durable.clock import Clock
from celery_durable.compat.amqp_cork import FrameCork, cork_for
from celery_durable.compat.host_types import HostMessage, HostRequest
from celery_durable.errors import InvariantBroken
from celery_durable.limits.gate import LimitGate
from celery_durable.planning.claim_sweep import (
    Sweep,
    begin_sweep,
    next_ask,
    overdraw_after,
    overdrawn,
    record,
    waitable_queues,
)
from celery_durable.planning.known_empty import NOTHING_KNOWN, KnownEmpty, after_pass, notified, pass_order
from celery_durable.planning.pass_replay import replay_pass
from celery_durable.planning.push_turn import push_queue
from celery_durable.worker.admission import Admitter
from celery_durable.worker.claim_stats import ClaimStats
from celery_durable.worker.consumed_order import ConsumedOrder
from celery_durable.worker.fetchers import (
    AckCarrier,
    Fetcher,
    NotifyingFetcher,
    PassFetcher,
    ProbingFetcher,
    fetcher_for,
    gives_back_in_place,
)
from celery_durable.worker.held_runs import HeldRuns
from celery_durable.worker.idle_wait import IdleWait, idle_wait_for
from celery_durable.worker.parking import parker_for
from celery_durable.worker.pass_kicks import PassKicks
from celery_durable.worker.probing import QueueProber
from celery_durable.worker.push_consumer import PushConsumer, push_consumer_for
from celery_durable.worker.queue_watch import QueueWatch, queue_watch_for
from celery_durable.worker.watch_deliveries import ClaimDepth, WatchDeliveries


class Claimer:
    """Fetches messages when the worker has room and hands them to Celery's task handler.

    Runs in the consumer's loop thread. ``kick()`` may be called from any
    thread; it coalesces into one pass on the loop thread. What a pass takes is
    admitted by worker/admission.py; the wait between passes is worker/idle_wait.py's.
    """

    def __init__(
        self,
        *,
        connection: Any,
        queues: Callable[[], Sequence[Any]],
        held: HeldRuns,
        accept: Any,
        schedule: Callable[[Callable[[], None]], None],
        clock: Clock,
        stop_requested: Callable[[], bool] = lambda: False,
        before_pass: Callable[[], None] = lambda: None,
        new_fetcher: Callable[[Any, Any], Fetcher] = fetcher_for,
        gate: LimitGate | None = None,
        hub: Any = None,
        push: bool = False,
        new_watch: Callable[..., QueueWatch | None] = queue_watch_for,
    ) -> None:
        self._connection = connection
        self._hub = hub
        self._queues = queues
        self.held = held
        self._accept = accept
        self._clock = clock
        self._stop_requested = stop_requested
        self._before_pass = before_pass
        self._new_fetcher = new_fetcher
        self.handler: Callable[[Any], Any] | None = None
        self.cursor: str | None = None
        self.running = False
        self._kicks = PassKicks(schedule, self.run_pass, hub)
        #: Ask for a pass soon, from any thread; many kicks before it runs make one pass.
        self.kick = self._kicks.kick
        self.kick_after_next_poll = self._kicks.after_next_poll
        self._admission = Admitter(held=held, gate=gate, handle=self._handle, clock=clock)
        self._gate = gate
        # Chosen at start, from the claim channel's transport.
        self._fetcher: Fetcher | None = None
        self._pass_fetcher: PassFetcher | None = None
        self._notifying_fetcher: NotifyingFetcher | None = None
        self._ack_carrier: AckCarrier | None = None
        #: RabbitMQ: the loop's frames of one hub round leave in one write (an early ack with the next get).
        self._cork: FrameCork | None = None
        #: Queues a pass may leave out (planning/known_empty.py); only with a broker that notifies.
        self._known_empty: KnownEmpty = NOTHING_KNOWN
        self._consumed_order = ConsumedOrder(queues, held.queues)
        self._idle: IdleWait | None = None
        #: What a probing fetcher's passes know of each queue's ready messages (RabbitMQ).
        self._prober: QueueProber | None = None
        self._push: PushConsumer | None = None
        self._may_push = push
        #: RabbitMQ: the queues a pass proved empty are consumed, not probed again (worker/queue_watch.py);
        #: what the watch is pushed is decided by worker/watch_deliveries.py, never inside a pass or an
        #: admission (``_depth`` counts those on the stack).
        self._watched: WatchDeliveries | None = None
        self._new_watch = new_watch
        self._depth = ClaimDepth()
        self.passes = 0
        #: Messages admitted from claim passes, and from the idle any-queue wait.
        self.claimed_by_passes = 0
        self.claimed_by_idle_wait = 0
        #: Messages the next pass takes beyond its room: grown while passes park or drop what they
        #: take (a flood of one busy key goes to the store in large batches), gone when they stop.
        self._overdraw = 0
        self._may_overdraw = False

    # -- lifecycle -----------------------------------------------------------
    @property
    def claiming(self) -> bool:
        # A SIGTERM sets Celery's shutdown flag from the signal handler while a
        # pass may be mid-way: the next ask sees it, not only the next pass.
        return self.running and not self._stop_requested()

    def start(self) -> None:
        channel = self._connection.channel()
        self._cork = cork_for(self._connection, self._hub)
        self._fetcher = self._new_fetcher(channel, self._accept)
        # What the fetcher can do is asked once: an isinstance against a
        # runtime-checkable protocol walks its members (~3 % of a pass).
        self._pass_fetcher = self._fetcher if isinstance(self._fetcher, PassFetcher) else None
        fetcher = self._fetcher
        self._prober = QueueProber(fetcher, self._clock) if isinstance(fetcher, ProbingFetcher) else None
        self._notifying_fetcher = self._fetcher if isinstance(self._fetcher, NotifyingFetcher) else None
        self._ack_carrier = self._fetcher if isinstance(self._fetcher, AckCarrier) else None
        if self._ack_carrier is not None:
            # A finished run's late ack comes a hub round after its result, and the kick its freed
            # slot made: the pass that kick runs carries it (while claiming; a stop sends it at once).
            self._ack_carrier.carry_acks(lambda: self._kicks.pending and self.claiming)
        self._known_empty = NOTHING_KNOWN
        self._admission.parker = parker_for(self._connection, channel)
        self._may_overdraw = gives_back_in_place(channel)
        self._idle = idle_wait_for(self._connection, channel, self._hub, accept=self._accept,
                                   on_wake=self.kick, on_delivery=self._idle_delivered)
        self._push = push_consumer_for(self._connection, channel, self._accept, self.held.room_for,
                                       self._push_delivered, self.held.holds,
                                       self.held.acked_as_it_ends) if self._may_push else None
        watch = self._new_watch(self._connection, channel, self._accept, self._watch_delivered,
                                self._clock) if self._prober is not None else None
        self._watched = (WatchDeliveries(self, watch, self._prober, self._depth)
                         if watch is not None and self._prober is not None else None)
        self.running = True
        # The first pass (and the idle wait it arms) runs now, before the worker
        # says ready, as stock Celery's consume does: a kick would queue it
        # beside asynloop's blocking 100 ms AMQP drain, which may go first.
        self._kicks.kicked()

    def stop(self) -> None:
        """Stop claiming now: a pass checks this between two asks."""
        self.running = False
        self._send_acks()
        cork, self._cork = self._cork, None
        if cork is not None:  # the hub may not poll again: nothing may stay held
            cork.close()
        if self._idle is not None:
            self._idle.cancel()
        if self._push is not None:
            self._push.stop()
        if self._watched is not None:
            self._watched.watch.unwatch_all()

    def _send_acks(self) -> None:
        if self._ack_carrier is not None:  # the acks no pass carried (none ran, or it failed) go now
            self._ack_carrier.send_acks()

    def close(self) -> None:
        self.stop()
        if self._idle is not None:
            self._idle.close()
        if self._push is not None:
            self._push.close()
        if self._watched is not None:
            self._watched.watch.close()

    def queues_changed(self) -> None:
        """A queue was cancelled: the idle wait must not go on consuming what it was armed on.

        Called on the loop thread (remote control runs there), before the
        command replies: a message sent to a cancelled queue after the reply
        must stay in the broker. The pass this kicks re-arms on the queues now consumed.
        """
        if self._idle is not None:
            self._idle.cancel()
        if self._push is not None:
            self._push.stop()
        if self._watched is not None:
            self._watched.forget()
        self._known_empty = NOTHING_KNOWN
        if self._prober is not None:
            self._prober.forget()
        self.kick()

    def stats(self) -> ClaimStats:
        idle, fetcher, push, watched = self._idle, self._fetcher, self._push, self._watched
        return ClaimStats(
            claimed_by_watch=watched.claimed if watched is not None else 0,
            watch_given_back=watched.given_back if watched is not None else 0,
            watch_credits=watched.watch.credits_given if watched is not None else 0,
            watching=watched.watch.watched() if watched is not None else frozenset(),
            claimed_by_push=push.delivered if push is not None else 0,
            pushing=push.queue if push is not None else None,
            passes=self.passes,
            claimed_by_passes=self.claimed_by_passes,
            claimed_by_idle_wait=self.claimed_by_idle_wait,
            idle_wakes=idle.wakes if idle is not None else 0,
            idle_waiting_on=frozenset(idle.waiting_on()) if idle is not None else frozenset(),
            round_trips=fetcher.round_trips if fetcher is not None else 0,
            handed_back=self._admission.handed_back,
        )

    # -- the pass --------------------------------------------------------------
    def run_pass(self) -> int:
        try:
            with self._depth:
                return self._claim()
        finally:
            self._send_acks()
            if self._gate is not None:
                # The leases of runs that ended go back with the pass's take (one round
                # trip); the ones no take carried (a pass with no limited message) now.
                self._gate.give_back_ended()
            self._decide_watched()

    def _claim(self) -> int:
        if not self.claiming or self.handler is None or self._fetcher is None or self._idle is None:
            return 0
        if self._admission.store_paused():
            return 0  # the safety timer's next kick tries again
        # A wait still armed could deliver beside the pass's asks and overshoot
        # the room read below; cancelling it first may itself admit one
        # message, which is counted before the room is read.
        self._idle.cancel()
        # Runs whose ETA fell due while the worker was full go before new claims.
        self._before_pass()
        queues, order = self.consumed_order()
        free = self.held.free_slots()  # every held queue's; a queue no longer consumed is left out
        if len(free) != len(order):
            free = {q: free[q] for q in order}
        room = self.held.room()
        if self._push is not None and self._push.follow(
                push_queue(order, free, room, self._push.queue, self._consumed_order.pushable)):
            return 0  # the broker pushes this pass's room: one open queue
        # A pass that asks beyond its room must check each run against the slots as it admits it;
        # one that does not cannot take more than its room, and skips that bookkeeping.
        bounded = self._overdraw > 0 and room > 0
        free, room = overdrawn(free, room, self._overdraw)
        watched = self._watched
        watch = watched.watch if watched is not None else None
        if self._prober is not None and room > 0:
            order, free = self._prober.probed(order, self.cursor, free,
                                              watch.watched() if watch is not None else frozenset())
            if watch is not None:
                # A pass with room lets the broker push one message from a watched queue: one landing
                # there since it was proved empty starts now, not when a probe would have found it.
                watch.give()
        full = True
        if self._notifying_fetcher is not None:
            self._known_empty = notified(self._known_empty, self._notifying_fetcher.notified())
            # Rotated here, before queues are left out: the turn is the whole order's.
            order, full = pass_order(order, self.cursor, self._known_empty, self._clock.monotonic())
        sweep = begin_sweep(order, free, room, self.cursor)
        self.passes += 1
        went_to_wait = handed_back = 0
        if self._pass_fetcher is not None and self.claiming:
            sweep, went_to_wait, handed_back = self._run_whole_pass(self._pass_fetcher, sweep, bounded, full)
        else:
            while self.claiming:
                ask, sweep = next_ask(sweep)
                if ask is None:
                    break
                taken, admitted, back = self._fetch(self._fetcher, queues[ask.queue], ask.count, bounded)
                if self._prober is not None:
                    self._prober.asked(ask.queue, ask.count, taken)
                sweep = record(sweep, ask, taken)
                went_to_wait += taken - admitted - back
                handed_back += back
        if self._may_overdraw:
            # Messages the store could not decide went back to the broker, not to wait: a pass paused
            # for the store takes no more than its room when it resumes (a larger one would only churn).
            store_down = self._admission.store_paused()
            self._overdraw = 0 if store_down else overdraw_after(went_to_wait, handed_back)
        if went_to_wait and not handed_back:
            # Messages parked (or gone to wait for a limit, or dropped) took room in this pass
            # without holding a slot; another pass fills it. Recording only the ones admitted would
            # read the queue as drained, and wait on it one delivery at a time. (A pass that gave
            # messages back ran out of slots: the runs that end kick the next.)
            self.kick()
        self.cursor = sweep.cursor
        self.claimed_by_passes += sweep.claimed
        if not full and self.claiming and self.held.room() > 0:
            # A pass that left queues out and still has room: one of them may hold what fills it
            # (a row no notification announced). A full pass now, before any idle wait is armed.
            self._known_empty = NOTHING_KNOWN
            self.kick()
        if watched is not None and self.claiming:
            watched.watch_proven_empty(queues)
        if self.claiming and self.held.room() > 0 and not self._kicks.pending:
            # Every queue with a free slot gave less than it was asked for: wait
            # on all of them at once instead of polling. Not while a kick is
            # pending (runs finished during the pass): that pass re-plans, and
            # arming now would cost a consume and a cancel for nothing.
            names = waitable_queues(self.held.queues(), self.held.free_slots(), self.held.room())
            if self._prober is not None:
                # What the wait does not deliver is not known after it: the pass it wakes probes afresh.
                self._prober.forget()
            self._idle.arm({name: queues[name] for name in names if name in queues})
        return sweep.claimed

    def _push_delivered(self, queue_name: str, message: HostMessage) -> None:
        self.cursor = queue_name
        with self._depth:
            # Bounded: a delivery the credit allowed before a slot went elsewhere (an ETA run fell due)
            # finds none, and goes back to the broker in place.
            self._admission.admit_all([(queue_name, message)], bounded=True)
        self._decide_watched()

    # -- the queue watch (RabbitMQ): worker/watch_deliveries.py -------------------------
    def _watch_delivered(self, queue_name: str, message: HostMessage) -> None:
        if self._watched is None:
            raise InvariantBroken("a watch delivery reached a claimer with no queue watch")
        self._watched.delivered(queue_name, message)

    def _decide_watched(self) -> None:
        if self._watched is not None:
            self._watched.decide_waiting()

    @property
    def admitting(self) -> bool:
        return self.claiming and self.handler is not None

    def admit_bounded(self, queue_name: str, message: HostMessage) -> int:
        admitted, _ = self._admission.admit_all([(queue_name, message)], bounded=True)
        return admitted

    def consumed_order(self) -> tuple[dict[str, Any], Sequence[str]]:
        return self._consumed_order.read()

    def _run_whole_pass(self, fetcher: PassFetcher, sweep: Sweep, bounded: bool,
                        full: bool) -> tuple[Sweep, int, int]:
        """The pass in one broker round trip; the planner replays its asks and must agree with each.

        Returns the sweep, how many messages took no slot (parked, waiting, dropped) and how many
        went back to the broker for want of one. With a broker that notifies, records the queues the
        pass proved empty (asked, and gave less than asked).
        """
        learning = self._notifying_fetcher is not None
        replayed = replay_pass(sweep, fetcher.claim_pass(sweep.to_ask, sweep.free, sweep.room), learning=learning)
        if learning:
            self._known_empty = after_pass(self._known_empty, full=full, now=self._clock.monotonic(),
                                           emptied=replayed.emptied)
        # A message already taken from the broker is admitted even if a stop came meanwhile: it is
        # counted, and the drain hands it back. Admitted together: the limit gate decides a pass's
        # limited messages in one store transaction.
        admitted, handed_back = self._admission.admit_all(replayed.taken, bounded)
        return replayed.sweep, replayed.unreadable + len(replayed.taken) - admitted - handed_back, handed_back

    def _fetch(self, fetcher: Fetcher, queue: Any, count: int, bounded: bool) -> tuple[int, int, int]:
        """(messages taken, of them admitted: holding a slot, given back: no slot left); admitted after a stop too."""
        messages = list(fetcher.fetch(queue, count, lambda: self.claiming))
        admitted, handed_back = self._admission.admit_all([(queue.name, message) for message in messages], bounded)
        return len(messages), admitted, handed_back

    def _handle(self, message: HostMessage) -> None:
        if self.handler is None:
            raise RuntimeError("the claimer was started before Celery gave it the task handler")
        self.handler(message)

    def bind_request(self, request: HostRequest) -> None:
        """Called as the strategy makes a request for the message being admitted."""
        self._admission.bind_request(request)

    def _idle_delivered(self, queue_name: str, message: HostMessage) -> None:
        """The idle wait took ``message`` itself (kombu's consumers): admit it, then plan the rest of the room."""
        self.cursor = queue_name
        self.claimed_by_idle_wait += 1
        with self._depth:
            # Admitted before the wait is cancelled (a synchronous round trip on AMQP): the wait's channel has a
            # prefetch of one, so nothing else arrives on it meanwhile; a watch delivery that cancel reads waits
            # until both are done. Bounded where the queue watch runs: the watch may have spent the room the wait
            # was armed for (unbounded, a third run started at cap 2 under load), and the message goes back in
            # place. Elsewhere unbounded: a Redis wait's BRPOP delivery has no in-place return.
            self._admission.admit_all([(queue_name, message)], bounded=self._watched is not None)
            if self._idle is not None:
                self._idle.cancel()
        self._decide_watched()
        # One message woke us: the rest of the room goes to planned asks, after the hub's next poll.
        self.kick_after_next_poll()
