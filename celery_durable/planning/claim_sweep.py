"""Which queue a claim pass asks, in what order, for how many: the pure sweep planner.

A pass splits the room it has over the queues it has not asked yet
(``ceil(room / queues left)``), each ask capped by the queue's free slots.
Queues are asked in the worker's order rotated to start after the last queue
given a job, so on a worker at its cap each freed slot goes to the next queue
in turn that has work. A queue that filled its share is asked again while room
is left; one with less work than its share leaves the rest to the queues after
it. The executor (``worker/claimer.py``) fetches; this module only decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

from celery_durable.errors import InvariantBroken


@dataclass(frozen=True)
class Ask:
    """Ask ``queue`` for at most ``count`` messages."""

    queue: str
    count: int
    #: True when the pass's share, not the queue's free slots, set ``count``:
    #: a queue that fills such an ask may have more work and is asked again.
    share_bound: bool


@dataclass(frozen=True)
class Sweep:
    """One claim pass part-way through: what is left to ask and the room left."""

    to_ask: tuple[str, ...]
    again: tuple[str, ...]
    free: MappingProxyType[str, int]
    #: Runs the process may still take; None when there is no process cap
    #: (then each queue is asked once, for its free slots).
    room: int | None
    #: The last queue given a job: the next pass starts after it.
    cursor: str | None
    claimed: int = 0


def rotate(queues: Sequence[str], cursor: str | None) -> tuple[str, ...]:
    """``queues`` in order, starting after ``cursor`` (unchanged if it is not one of them)."""
    order = tuple(queues)
    try:
        start = order.index(cursor) + 1
    except ValueError:
        return order
    return order[start:] + order[:start]


def begin_sweep(
    queues: Sequence[str],
    free: Mapping[str, int],
    room: int | None,
    cursor: str | None,
) -> Sweep:
    """Plan a pass over ``queues`` with ``free`` slots each and ``room`` under the process cap."""
    distinct = set(queues)
    if len(distinct) != len(queues):
        raise InvariantBroken(f"queues must be distinct, got {list(queues)!r}")
    # Checked whole first (set and min run in C: a pass over 200 queues plans in microseconds); the
    # walk that names the culprit runs only when something is wrong.
    if not free.keys() >= distinct or min(free.values(), default=0) < 0:
        for queue in queues:
            slots = free.get(queue)
            if slots is None or slots < 0:
                raise InvariantBroken(f"free slots of queue {queue!r} must be >= 0, got {slots!r}")
    if room is not None and room < 0:
        raise InvariantBroken(f"room must be >= 0 or None, got {room!r}")
    return Sweep(
        to_ask=rotate(queues, cursor),
        again=(),
        free=MappingProxyType(dict(free)),
        room=room,
        cursor=cursor,
    )


def next_ask(sweep: Sweep) -> tuple[Ask | None, Sweep]:
    """The next ask of the pass, or None when the pass is over; and the sweep without it."""
    while True:
        if sweep.room == 0:
            return None, sweep
        if not sweep.to_ask:
            if not sweep.again:
                return None, sweep
            sweep = replace(sweep, to_ask=sweep.again, again=())
        queue, rest = sweep.to_ask[0], sweep.to_ask[1:]
        sweep = replace(sweep, to_ask=rest)
        slots = sweep.free[queue]
        if slots == 0:
            continue  # at its own slot limit: skipped, not asked
        if sweep.room is None:
            return Ask(queue, slots, share_bound=False), sweep
        share = -(-sweep.room // (len(rest) + 1))  # ceil(room / queues left, this one included)
        if share < slots:
            return Ask(queue, share, share_bound=True), sweep
        return Ask(queue, slots, share_bound=False), sweep


def skip_to(sweep: Sweep, queue: str) -> Sweep:
    """The sweep just before ``queue``'s next ask, every ask ahead of it having brought nothing.

    An ask that brings nothing changes only the sweep's place in its order, so
    a broker that runs a whole pass reports just the asks that took messages
    and the replay skips to each. Raises InvariantBroken if ``queue`` is not
    ahead in this round or the next.
    """
    to_ask, again, place = _place_of(sweep, queue)
    return replace(sweep, to_ask=to_ask[place:], again=again)


def _place_of(sweep: Sweep, queue: str) -> tuple[tuple[str, ...], tuple[str, ...], int]:
    """(to ask, again, index of ``queue`` in to ask) once ``queue``'s round is the current one."""
    to_ask, again = sweep.to_ask, sweep.again
    try:
        return to_ask, again, to_ask.index(queue)
    except ValueError:
        if queue not in again:
            raise InvariantBroken(f"queue {queue!r} has no ask left in the pass (to ask {list(to_ask)!r}, "
                                  f"again {list(again)!r})") from None
        return again, (), again.index(queue)


def passed_over(sweep: Sweep, queue: str) -> tuple[str, ...]:
    """The queues ``skip_to(sweep, queue)`` passes over that had a free slot: asked, and they gave nothing."""
    to_ask, again, place = _place_of(sweep, queue)
    # ``again`` emptied: ``queue`` is in the next round, and the whole of this one was passed over too.
    ahead = to_ask[:place] if again == sweep.again else sweep.to_ask + to_ask[:place]
    return tuple(q for q in ahead if sweep.free[q] > 0)


def unanswered(sweep: Sweep) -> tuple[str, ...]:
    """At the end of a pass that still had room: the queues with a free slot it asked again or would
    have asked next, all of which gave nothing (a pass stops early only when its room runs out)."""
    if sweep.room == 0:
        return ()
    return tuple(q for q in sweep.to_ask + sweep.again if sweep.free[q] > 0)


def record(sweep: Sweep, ask: Ask, got: int) -> Sweep:
    """The sweep after ``ask`` brought ``got`` messages."""
    if not 0 <= got <= ask.count:
        raise InvariantBroken(f"an ask for {ask.count} from {ask.queue!r} cannot bring {got}")
    if got == 0:
        return sweep
    free = sweep.free.copy()  # the proxy's own dict copied in C (dict(proxy) reads it key by key)
    free[ask.queue] -= got
    room = None if sweep.room is None else sweep.room - got
    again = sweep.again
    if ask.share_bound and got == ask.count and free[ask.queue] > 0:
        again = again + (ask.queue,)
    return replace(
        sweep,
        free=MappingProxyType(free),
        room=room,
        again=again,
        cursor=ask.queue,
        claimed=sweep.claimed + got,
    )


#: The most messages a pass takes beyond its room (``overdrawn``): one store transaction parks them.
MAX_OVERDRAW = 64


def overdraw_after(went_to_wait: int, handed_back: int) -> int:
    """How many messages the next pass takes beyond its room, after a pass in which ``went_to_wait``
    took no slot (parked for a busy key or a later rate turn, dropped, poison) and ``handed_back``
    could have run but found no slot.

    A pass whose messages all wait left its room free: asking for twice as many
    next time parks a flood of one busy key in a few large batches (a slot's
    worth per pass made 1,000 waiting messages cost hundreds of passes, holding
    other keys' messages behind them). Each message given back costs a
    round trip for nothing, so they pull the overdraw down; none waiting ends it.
    """
    return max(0, min(MAX_OVERDRAW, 2 * went_to_wait - handed_back))


def overdrawn(free: Mapping[str, int], room: int, extra: int) -> tuple[dict[str, int], int]:
    """``free`` and ``room`` with ``extra`` more for every queue that has a free slot, when there is room.

    A worker with no room takes nothing: its slots are what it claims for.
    """
    if extra <= 0 or room <= 0:
        return dict(free), room
    return {queue: slots + extra if slots > 0 else 0 for queue, slots in free.items()}, room + extra


def waitable_queues(queues: Sequence[str], free: Mapping[str, int], room: int | None) -> tuple[str, ...]:
    """The queues an idle worker may wait on at once: those with a free slot, if it has room."""
    if room == 0:
        return ()
    return tuple(queue for queue in queues if free.get(queue, 0) > 0)

