"""Whether a message the RabbitMQ queue watch was pushed may run now, in the rotated turn: the pure rule.

The watch consumes queues a claim pass proved empty, so a message landing on one is pushed at
once instead of waiting for a probe. Pushing skips the claim passes' strict rotated turn (a, b, c
across the queues with work), so a pushed message runs only where the turn would have given it
the slot anyway: the worker has room, its queue has a free slot, and no queue ahead of it in the
turn is known to hold work. Otherwise it goes back to the broker in place, and the passes ask its
queue in turn.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from celery_durable.planning.claim_sweep import rotate


def runs_now(queue: str, order: Sequence[str], cursor: str | None, holding_work: Collection[str],
             free: Mapping[str, int], room: int) -> bool:
    """Whether a message pushed from ``queue`` takes a slot now.

    ``order``: the worker's queues in their turn order; ``cursor``: the queue served last (the
    turn starts after it); ``holding_work``: queues known to hold ready messages; ``free``: free
    slots per queue; ``room``: the worker's room. A queue ahead that has no free slot has no turn
    to lose, so only open queues ahead count.
    """
    if room <= 0 or free.get(queue, 0) <= 0:
        return False
    for ahead in rotate(order, cursor):
        if ahead == queue:
            return True
        if ahead in holding_work and free.get(ahead, 0) > 0:
            return False
    return False  # not one of the worker's queues (cancelled meanwhile): the passes decide
