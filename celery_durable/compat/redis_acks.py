"""kombu's Redis ack split in two: the channel's in-memory record at once, the Redis write with the next claim pass.

kombu's ``QoS.ack`` (``kombu/transport/redis.py``, 5.x) removes the tag from
the unacked index and hash in a pipeline of its own (one round trip), then
from the channel's in-memory record of what it delivered
(``virtual.QoS.ack``). A finished run's late ack is followed at once by the
claim pass its freed slot kicks: the Redis half can ride in that pass's script
(``redis_claim.claim_pass``'s ``acks``) instead of costing a round trip of its
own. The in-memory half is never deferred: kombu's restore of a closing
channel (``QoS.restore_unacked_once``) reads that record, and must not put a
finished run's message back. Pinned by tests/compat/test_redis_acks.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kombu.transport import virtual

from celery_durable.compat.redis_claim import key_prefix, unprefixed


def defer_acks(channel: Any, defer: Callable[[Any], bool]) -> None:
    """Route ``channel``'s ``basic_ack`` through ``defer(tag)``: True means the caller sends the Redis half later.

    ``Message.ack`` calls ``channel.basic_ack(tag)`` (kombu 5.x); the
    channel's ``basic_reject`` is left alone (a requeue restores the message,
    so the unacked record must go with it, in one transaction, now).
    """
    ack_now = channel.basic_ack

    def basic_ack(delivery_tag: Any, multiple: bool = False) -> None:
        if not multiple and defer(delivery_tag):
            virtual.QoS.ack(channel.qos, delivery_tag)
        else:
            ack_now(delivery_tag, multiple=multiple)

    channel.basic_ack = basic_ack


def unacked_keys(channel: Any) -> tuple[str, str]:
    """The unacked index and hash as the server names them (behind ``global_keyprefix``)."""
    prefix = key_prefix(channel)
    return prefix + channel.qos.unacked_index_key, prefix + channel.qos.unacked_key


def send_acks(channel: Any, client: Any, tags: Sequence[Any], held_key: str | None) -> None:
    """The Redis half of ``tags``' acks in one round trip: what ``QoS.ack`` writes, and the held-set entry.

    The held-set entry would be pruned by the next heartbeat anyway
    (``redis_holders``); removing it here spares that beat the lookup.
    """
    index, unacked = unacked_keys(channel)
    with unprefixed(client).pipeline(transaction=False) as pipe:
        for tag in tags:
            pipe.zrem(index, tag)
            pipe.hdel(unacked, tag)
            if held_key is not None:
                pipe.zrem(held_key, tag)
        pipe.execute()
