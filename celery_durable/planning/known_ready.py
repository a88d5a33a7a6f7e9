"""Which queues a RabbitMQ claim pass must probe for ready messages, and which it may ask or skip: the pure rules.

A worker serving many queues learns which hold work with a passive ``queue.declare`` each (a
probe); asked before every pass, 200 of them cost a busy worker four fifths of its throughput.
Most of it is not needed:

- a ``basic.get``'s ``GetOk`` carries the queue's remaining ready count, so a queue known to hold
  work is asked, never probed; an ask that brings less than it asked proves its queue empty;
- a queue proven empty (by a probe, by a ``GetOk`` saying none remain, by an ask that came back
  short) is left out of passes, unprobed, for ``PROBED_EMPTY_FOR`` seconds — the wait a message
  landing on it may have while other queues keep the worker busy — and then probed again. While
  the worker has room, the idle wait consumes every queue, so nothing landing there waits at all;
- a queue the RabbitMQ queue watch consumes (worker/queue_watch.py) is never probed: a message
  landing on it is pushed to the worker, and its queue is then asked in turn (``after_delivery``).

The turn is untouched: the order is rotated whole, then the queues known empty are left out (the
PostgreSQL broker's rule, planning/known_empty.py, whose ``KnownEmpty`` holds the empty ones here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import filterfalse

from celery_durable.planning.claim_sweep import rotate
from celery_durable.planning.known_empty import NOTHING_KNOWN, KnownEmpty

#: How long a proof that a queue is empty is trusted (seconds): the longest a message landing on it
#: waits for a probe while the worker is busy on other queues (half that on average). Stock Celery's
#: own wait there is the prefetch buffer it holds ahead of the late message: 12-20 ms p50 for no-op
#: tasks at prefork -c2 (benchmarks/worker_bench.py --scenarios late). Probing 200 empty queues every
#: 20 ms costs about a tenth of a busy worker's loop; every 10 ms (the old rule) cost over half.
PROBED_EMPTY_FOR = 0.02


@dataclass(frozen=True)
class KnownReady:
    """What the worker knows of its queues' ready messages without asking the broker.

    ``counts``: queues known to hold work, with their ready messages as last read (a probe or the
    last ``GetOk``). ``empty``: queues proven empty, and when the oldest of those proofs was made.
    A queue in neither is unknown: the next pass probes it.
    """

    counts: Mapping[str, int] = field(default_factory=dict)
    empty: KnownEmpty = NOTHING_KNOWN


NOTHING_READY_KNOWN = KnownReady()


def trusted_empty(known: KnownReady, now: float) -> frozenset[str]:
    """The queues a pass may leave out now: proven empty no longer than ``PROBED_EMPTY_FOR`` ago."""
    empty = known.empty
    if empty.full_at is None or not 0 <= now - empty.full_at <= PROBED_EMPTY_FOR:
        return frozenset()
    return empty.queues


def to_probe(known: KnownReady, order: Sequence[str], free: Mapping[str, int], now: float,
             watched: frozenset[str] = frozenset()) -> list[str]:
    """The open queues of ``order`` (free slots > 0) whose ready messages this pass must learn first.

    None when fewer than two are open: the one ask costs what its probe would. Otherwise every open
    queue neither known to hold work, nor trusted empty, nor ``watched``. Set differences first (in
    C): a busy worker among 200 queues asks this before every claim, and almost always needs nothing.
    """
    unknown = free.keys() - known.counts.keys() - trusted_empty(known, now) - watched
    if not unknown or sum(1 for slots in free.values() if slots > 0) < 2:
        return []
    return [q for q in order if q in unknown and free[q] > 0]


def after_probe(known: KnownReady, ready: Mapping[str, int], now: float) -> KnownReady:
    """What is known after a probe read ``ready`` (messages per queue) at ``now``.

    Queues found empty join the trusted ones; if the trusted ones had expired, the probe asked them
    all again (``to_probe``), so their proofs restart at ``now``.
    """
    counts = dict(known.counts)
    found_empty = set()
    for queue, n in ready.items():
        if n > 0:
            counts[queue] = n
        else:
            counts.pop(queue, None)
            found_empty.add(queue)
    still = trusted_empty(known, now)
    if not still:
        return KnownReady(counts, KnownEmpty(frozenset(found_empty), now))
    return KnownReady(counts, KnownEmpty(still | found_empty, known.empty.full_at))


def after_ask(known: KnownReady, queue: str, *, asked: int, got: int, remaining: int | None,
              now: float) -> KnownReady:
    """What is known after an ask of ``queue`` for ``asked`` brought ``got``; ``remaining``: the last
    ``GetOk``'s count of messages left (None when no message came, or the broker did not say)."""
    counts = known.counts
    if got < asked or remaining == 0:
        empty = trusted_empty(known, now)
        if queue not in counts and queue in empty:
            return known
        rest = {q: n for q, n in counts.items() if q != queue}
        # Kept with the older proofs' time: the queue is probed again no later than they are.
        if empty:
            return KnownReady(rest, KnownEmpty(empty | {queue}, known.empty.full_at))
        return KnownReady(rest, KnownEmpty(frozenset((queue,)), now))
    if remaining is None:
        # Took all it asked, count unsaid: more may be there, or none; the next pass probes it.
        if queue not in counts:
            return known
        return KnownReady({q: n for q, n in counts.items() if q != queue}, known.empty)
    if counts.get(queue) == remaining:
        return known
    return KnownReady({**counts, queue: remaining}, known.empty)


def pass_queues(order: Sequence[str], cursor: str | None, free: Mapping[str, int], known: KnownReady,
                now: float, watched: frozenset[str] = frozenset()) -> tuple[tuple[str, ...], dict[str, int]]:
    """The pass's order (``order`` rotated after ``cursor``, then less the queues trusted empty and the
    ``watched`` ones not known to hold work), and each of those queues' free slots capped by its known
    ready messages (a queue still unknown, when there was nothing to probe, keeps its slots). Rotated
    before queues are left out: the turn is the whole order's."""
    skipped = trusted_empty(known, now)
    if watched:
        skipped = skipped | (watched - known.counts.keys())
    rotated = rotate(order, cursor)
    asked = tuple(filterfalse(skipped.__contains__, rotated)) if skipped else rotated
    counts = known.counts
    return asked, {q: min(free[q], counts[q]) if q in counts else free[q] for q in asked}


def after_delivery(known: KnownReady, queue: str) -> KnownReady:
    """What is known once the queue watch was pushed a message from ``queue``: it held work.

    Whether more is there the push does not say (a ``basic.deliver`` carries no count): the next
    pass asks it, in turn, as a queue holding at least one; an ask that comes back short proves it
    empty again.
    """
    counts = known.counts
    if counts.get(queue, 0) >= 1 and queue not in known.empty.queues:
        return known
    empty = known.empty
    if queue in empty.queues:
        empty = KnownEmpty(empty.queues - {queue}, empty.full_at)
    return KnownReady({**counts, queue: max(counts.get(queue, 0), 1)}, empty)
