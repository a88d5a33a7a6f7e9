"""Pure: the fleet rate limit's arithmetic (GCRA) and what a checked message does with the store's answer.

A rate of ``count`` per ``period`` lets one run start every ``interval =
period / count`` seconds, evenly, with ``burst`` starts allowed back to back.
The state is one timestamp per task, the theoretical arrival time (TAT): the
moment the next run could start at the steady rate. A message that is early
does not come back to ask again (that is a busy loop): it *books* the next
start, moving the TAT on, and waits in the store until its booked time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from celery_durable.planning.limit_declarations import Rate, Scope

#: What the gate does with a message once the store has answered.
RUN = "run"            # every lease taken: hand it to Celery
WAIT = "wait"          # a scope is busy or its rate turn is later: parked in the store, acked
DROP = "drop"          # a scope is busy and the task drops when busy: acked, counted, not run
FAIL = "fail"          # the task's key function failed for this message: the run fails, named
BACK = "back"          # it could run, but the pass has no slot left for it: back to the broker, nothing taken


@dataclass(frozen=True)
class RateTurn:
    """When a run may start, and the TAT once it has booked that start."""

    start_at: datetime
    tat: datetime

    def waits(self, now: datetime) -> bool:
        return self.start_at > now


def book_rate_turn(tat: datetime | None, now: datetime, interval: float, burst: int = 1) -> RateTurn:
    """Book the next start of a task rate limited to one per ``interval`` s (``burst`` back to back).

    A run may start once ``now`` reaches ``TAT - (burst - 1) * interval``; a
    run that must wait books that time, so each waiting message holds its own
    turn and the turns stay ``interval`` apart however many are waiting.
    """
    if interval <= 0 or burst < 1:
        raise ValueError(f"interval must be > 0 and burst >= 1, got {interval!r}, {burst!r}")
    current = now if tat is None or tat < now else tat
    # Compared in seconds before any timedelta is made: a burst of millions at "1/d" spans more
    # than a timedelta (or a datetime minus it) can hold, and it only ever means "start now".
    tolerance = interval * (burst - 1)
    start_at = now if tolerance >= (current - now).total_seconds() else current - timedelta(seconds=tolerance)
    return RateTurn(start_at=start_at, tat=current + timedelta(seconds=interval))


def return_rate_turn(tat: datetime, interval: float) -> datetime:
    """The TAT after a booked turn is given back (its run never started): one interval earlier."""
    return tat - timedelta(seconds=interval)


# -- one batch of claimed messages against the scopes' state, decided in memory -------------------
@dataclass(frozen=True)
class LimitAsk:
    """One claimed message of a limited task: the leases it needs and what it does when busy."""

    task: str
    task_id: str
    scopes: tuple[Scope, ...]
    rate: Rate | None
    when_busy: str
    #: The queue it was claimed from (whose free slots a run takes: ``RunRoom``).
    queue: str = ""


@dataclass
class RunRoom:
    """The runs a claim pass may still start: in all, and per queue.

    A pass may take more messages than it has slots (``planning.claim_sweep``'s
    overdraw): the ones that wait or are dropped need none, and a flood of one
    busy key is parked in a few large batches instead of a slot's worth at a
    time. A message that could run once this room is spent goes back to the broker.
    """

    total: int
    per_queue: dict[str, int]

    def take(self, queue: str) -> bool:
        """Spend a slot of ``queue`` for one run; False (nothing spent) when there is none."""
        if self.total <= 0 or self.per_queue.get(queue, 0) <= 0:
            return False
        self.total -= 1
        self.per_queue[queue] -= 1
        return True

    def fits(self, queues: list[str]) -> bool:
        """Whether runs from ``queues`` (one per item) all fit, spending nothing."""
        wanted: dict[str, int] = {}
        for queue in queues:
            wanted[queue] = wanted.get(queue, 0) + 1
        return len(queues) <= self.total and all(self.per_queue.get(q, 0) >= n for q, n in wanted.items())


@dataclass
class ScopeState:
    """One scope as read under its lock (expired leases already deleted)."""

    live: int
    #: Task ids with a lease booked here for them (holder NULL): a waiter made ready.
    booked: set[str] = field(default_factory=set)
    #: Task ids whose lease here a worker holds.
    held: set[str] = field(default_factory=set)
    #: Messages parked on this scope, not made ready yet.
    waiting: int = 0
    #: The lowest limit a live worker declares for the scope's task and kind, when lower than the
    #: asker's own: the strictest declaration applies fleet-wide (a rolling deploy changing a limit).
    limit: int | None = None

    def limit_of(self, scope: Scope) -> int:
        return scope.limit if self.limit is None else min(scope.limit, self.limit)


@dataclass(frozen=True)
class Decision:
    verdict: str
    busy: Scope | None = None
    #: WAIT for a rate turn: when the message is published again.
    publish_at: datetime | None = None
    holds_rate_turn: bool = False


@dataclass
class BatchPlan:
    """What the store writes for a batch, and the verdict of each message in order."""

    decisions: list[Decision] = field(default_factory=list)
    #: (scope, task id, booked): leases the batch's runs take — a booking of theirs, or a new row.
    leases: list[tuple[Scope, str, bool]] = field(default_factory=list)
    #: (index of the ask, scope or None for a rate turn, publish_at or None): messages to park.
    parked: list[tuple[int, Scope | None, datetime | None]] = field(default_factory=list)
    #: (task, task id, start_at): rate turns booked for parked messages.
    rate_bookings: list[tuple[str, str, datetime]] = field(default_factory=list)
    #: (task, task id): rate bookings the batch's messages came back with, used now.
    used_rate_bookings: list[tuple[str, str]] = field(default_factory=list)
    #: The rate limits' new TATs, per task.
    tats: dict[str, datetime] = field(default_factory=dict)
    #: Waiters to make ready, per scope (oldest first), before the batch's own messages.
    ready: dict[Scope, int] = field(default_factory=dict)


def plan_batch(asks: list[LimitAsk], scopes: dict[Scope, ScopeState], parked_ids: set[str],
               rate_booked: set[tuple[str, str]], tats: dict[str, datetime | None], now: datetime,
               room: RunRoom | None = None) -> BatchPlan:
    """Decide each ask in arrival order; ``scopes``' states are updated as the decisions take leases.

    Waiters parked earlier go first: where a scope has room and waiters, they
    are made ready before a message of this batch may take a lease there. A
    message that could run when ``room`` (the pass's slots) is spent is BACK:
    it takes no lease and keeps its rate turn unbooked, so a later message of
    its key, finding the same lease free, is BACK too and the key's order holds.
    """
    plan = BatchPlan()
    current_tats = dict(tats)
    for index, ask in enumerate(asks):
        if ask.task_id in parked_ids:
            # Another copy of a message already parked: the parked one will run.
            plan.decisions.append(Decision(WAIT))
            continue
        holds_turn = False
        used_booking = False
        if ask.rate is not None:
            if (ask.task, ask.task_id) in rate_booked:
                rate_booked.discard((ask.task, ask.task_id))
                plan.used_rate_bookings.append((ask.task, ask.task_id))
                used_booking = True
            else:
                turn = book_rate_turn(current_tats.get(ask.task), now, ask.rate.interval, ask.rate.burst)
                current_tats[ask.task] = plan.tats[ask.task] = turn.tat
                if turn.waits(now):
                    plan.rate_bookings.append((ask.task, ask.task_id, turn.start_at))
                    plan.parked.append((index, None, turn.start_at))
                    plan.decisions.append(Decision(WAIT, publish_at=turn.start_at))
                    continue
            holds_turn = True
        busy = next((scope for scope in ask.scopes if not _fits(scope, scopes[scope], ask.task_id, plan)), None)
        if busy is not None:
            if holds_turn and ask.rate is not None:
                tat = current_tats.get(ask.task)
                if tat is not None:
                    current_tats[ask.task] = plan.tats[ask.task] = return_rate_turn(tat, ask.rate.interval)
            if ask.when_busy == DROP:
                plan.decisions.append(Decision(DROP, busy=busy))
            else:
                scopes[busy].waiting += 1
                plan.parked.append((index, busy, None))
                plan.decisions.append(Decision(WAIT, busy=busy))
            continue
        if room is not None and not room.take(ask.queue):
            if used_booking:  # it goes back with its booked turn, which it uses when it comes again
                plan.used_rate_bookings.pop()
                rate_booked.add((ask.task, ask.task_id))
            elif holds_turn and ask.rate is not None:
                tat = current_tats.get(ask.task)
                if tat is not None:  # the turn it booked just now goes back
                    current_tats[ask.task] = plan.tats[ask.task] = return_rate_turn(tat, ask.rate.interval)
            plan.decisions.append(Decision(BACK))
            continue
        for scope in ask.scopes:
            state = scopes[scope]
            booked = ask.task_id in state.booked
            if booked:
                state.booked.discard(ask.task_id)
            else:
                state.live += 1
            state.held.add(ask.task_id)
            plan.leases.append((scope, ask.task_id, booked))
        plan.decisions.append(Decision(RUN, holds_rate_turn=holds_turn))
    return plan


def _fits(scope: Scope, state: ScopeState, task_id: str, plan: BatchPlan) -> bool:
    if task_id in state.held:
        # Another copy of this run holds a lease here (delivered again while the
        # first runs, or its worker died less than a TTL ago): this one waits.
        return False
    if task_id in state.booked:
        return True
    free = state.limit_of(scope) - state.live
    if free > 0 and state.waiting > 0:
        # Waiters first, in arrival order: this message queues behind them.
        made_ready = min(free, state.waiting)
        state.waiting -= made_ready
        state.live += made_ready
        plan.ready[scope] = plan.ready.get(scope, 0) + made_ready
        free -= made_ready
    return free > 0
