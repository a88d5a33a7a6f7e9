"""When a worker may let the broker push to it: the one open queue, where no queue's turn is at stake."""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence


def push_queue(order: Sequence[str], free: Mapping[str, int], room: int, serving: str | None = None,
               pushable: Container[str] | None = None) -> str | None:
    """The queue to consume push-style, or None for the rotated turn of ``basic.get`` asks.

    A queue is *open* while it has a free slot: one at its per-queue cap
    (``durable_queue_concurrency``) cannot take a run, whatever it holds, so it
    has no turn to lose. With exactly one open queue every free slot can only
    go to it, and a push consumer with the credit set to the worker's room is
    exactly a claim. With two or more open the strict rotated turn decides.
    A worker with no room has no queue open, and no reason to switch: it keeps
    the queue it is ``serving`` (None: the rotated turn), as a full worker asks
    for nothing either way. A queue not in ``pushable`` (None: every queue is;
    RabbitMQ's quorum and stream queues take no consumer on the push channel) stays in the turn.
    """
    if room <= 0:
        return serving
    open_queues = [queue for queue in order if free.get(queue, 0) > 0]
    if len(open_queues) != 1 or (pushable is not None and open_queues[0] not in pushable):
        return None
    return open_queues[0]
