"""Which queues a claim pass may leave out because they are known to be empty: the pure rules.

A pass over many queues costs in proportion to their number (the broker's walk, the planner's),
although a busy worker usually finds work on a few. A broker that says which queues got rows
(the PostgreSQL broker's NOTIFY on each insert) lets a pass leave out the queues the last full
pass proved empty, until a notification names them. Rows also become ready without a
notification — a lapsed lease, a countdown come due, a requeue —, so what a full pass proved
is trusted for ``KNOWN_EMPTY_FOR`` seconds only; and a pass that leaves out queues and still
has room is followed at once by a full pass (the claimer's rule), so an idle worker never waits
on a queue it skipped. The rotated turn is untouched: the queues left out had nothing to give.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import filterfalse

from celery_durable.planning.claim_sweep import rotate

#: How long a full pass's proof that a queue is empty is trusted (seconds). Rows that come back
#: without a notification (a dead holder's lapsed lease, a countdown come due) wait at most this
#: long for a worker busy on other queues; a full pass costs a 200-queue worker ~0.3 ms more than
#: a narrowed one, so one every 25 ms is ~1 % of a pass a millisecond.
KNOWN_EMPTY_FOR = 0.025


@dataclass(frozen=True)
class KnownEmpty:
    """The queues a pass proved empty and when the last full pass ran (monotonic seconds)."""

    queues: frozenset[str] = frozenset()
    full_at: float | None = None


NOTHING_KNOWN = KnownEmpty()


def pass_order(queues: Sequence[str], cursor: str | None, known: KnownEmpty,
               now: float) -> tuple[tuple[str, ...], bool]:
    """The order this pass asks (``queues`` rotated after ``cursor``), less the queues known empty;
    and whether the pass is full (leaves nothing out). A pass that would leave out every queue is full."""
    order = rotate(queues, cursor)
    if not known.queues or known.full_at is None or now - known.full_at > KNOWN_EMPTY_FOR:
        return order, True
    narrowed = tuple(filterfalse(known.queues.__contains__, order))  # in C: a pass over 200 queues is busy
    if not narrowed:
        return order, True
    return narrowed, False


def after_pass(known: KnownEmpty, *, full: bool, now: float, emptied: Iterable[str]) -> KnownEmpty:
    """What is known after a pass that proved ``emptied`` empty (asked, and gave less than asked).

    A full pass replaces what was known and restarts its clock; a narrowed one adds to it.
    """
    if full:
        return KnownEmpty(frozenset(emptied), now)
    more = frozenset(emptied) - known.queues
    return KnownEmpty(known.queues | more, known.full_at) if more else known


def notified(known: KnownEmpty, queues: set[str] | None) -> KnownEmpty:
    """What is known after the broker said ``queues`` got rows; None: it may have missed some, so nothing is."""
    if queues is None:
        return NOTHING_KNOWN
    if not queues or known.queues.isdisjoint(queues):
        return known
    return KnownEmpty(known.queues - queues, known.full_at)
