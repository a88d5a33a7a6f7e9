"""py-amqp below kombu: pipelined ``basic.get`` and a publish that does not wait for its confirm."""

from __future__ import annotations

from typing import Any

from amqp import spec


def supports_pipelined_gets(channel: Any) -> bool:
    """A py-amqp channel (kombu's ``pyamqp``/``amqp`` transport), not librabbitmq's."""
    return hasattr(channel, "send_method")


def pipelined_gets(channel: Any, queue: str, count: int) -> list[Any]:
    """Write ``count`` ``basic.get`` at once, then read the replies in order; returns the messages got.

    AMQP answers a channel's methods in order, so n gets cost about one round
    trip. py-amqp has no public API for it: ``Channel.send_method`` with the
    ``Basic.Get`` frame format ``"Bsb"``, ``Channel.wait`` for ``GetOk``/``GetEmpty``
    and ``Channel._on_get_ok`` to build the message (py-amqp 5.x ``amqp/channel.py``).
    Every reply is read before returning: an unread GetOk would leave a message
    unacked on this channel with nobody holding it.
    """
    for _ in range(count):
        channel.send_method(spec.Basic.Get, "Bsb", (0, queue, False))
    replies = [channel.wait([spec.Basic.GetOk, spec.Basic.GetEmpty], returns_tuple=True) for _ in range(count)]
    return [channel._on_get_ok(*reply) for reply in replies if reply and len(reply) >= 2]


def pipelined_ready_counts(channel: Any, queues: list[str]) -> dict[str, int]:
    """Each queue's ready messages, for all of ``queues`` in about one round trip.

    A passive ``queue.declare`` per queue, all written before any reply is read
    (py-amqp has no public pipelining: ``Channel.send_method`` with the
    ``Queue.Declare`` frame format ``"BsbbbbbF"``, as ``Channel.queue_declare``
    writes it in py-amqp 5.x, then ``Channel.wait`` for each ``DeclareOk``,
    whose message count is the ready messages, not those held unacked).
    """
    for queue in queues:
        channel.send_method(spec.Queue.Declare, "BsbbbbbF", (0, queue, True, False, False, False, False, {}))
    counts = {}
    for queue in queues:
        _, message_count, _ = channel.wait(spec.Queue.DeclareOk, returns_tuple=True)
        counts[queue] = int(message_count)
    return counts


def publish_unconfirmed(channel: Any, message: Any, *, exchange: str, routing_key: str,
                        mandatory: bool = False, immediate: bool = False) -> None:
    """py-amqp's plain publish (``Channel._basic_publish``, 5.x) on a channel in confirm mode.

    With ``confirm_publish`` set, ``basic_publish`` waits for each ack in turn;
    a batch sends them all and waits for the acks together.
    """
    channel._basic_publish(message, exchange=exchange, routing_key=routing_key,
                           mandatory=mandatory, immediate=immediate)
