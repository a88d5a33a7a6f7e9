"""py-amqp below kombu: pipelined ``basic.get`` and a publish that does not wait for its confirm."""

from __future__ import annotations

import struct
from functools import lru_cache
from typing import Any

from amqp import spec
from amqp.serialization import dumps


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

    A passive ``queue.declare`` per queue, all written before any reply is read;
    each ``DeclareOk``'s message count is the queue's ready messages, not those
    held unacked. py-amqp has no public pipelining, and its method layer cost
    ~20 us of CPU per queue (encoding the same arguments every time, a promise
    and a dispatch per reply): a worker serving 200 queues spent most of its
    loop probing. So the arguments are encoded once per queue name and written
    through the connection's ``frame_writer`` (the locked writer
    ``Channel.send_method`` uses, py-amqp 5.x ``method_framing.py``), and the
    replies are read as frames: this channel's ``DeclareOk`` is parsed here, and
    every other frame (another channel's delivery, a heartbeat, a
    ``channel.close`` for a queue that is gone) goes to the connection's own
    ``on_inbound_frame``, as ``Connection.blocking_read`` hands it on.
    """
    connection = channel.connection
    channel_id = channel.channel_id
    write = connection.frame_writer
    for queue in queues:
        write(1, channel_id, spec.Queue.Declare, _passive_declare_arguments(queue), None)
    read_frame = connection.transport.read_frame
    counts: dict[str, int] = {}
    while len(counts) < len(queues):
        frame = read_frame()
        frame_type, frame_channel, payload = frame
        if frame_type == _METHOD_FRAME and frame_channel == channel_id and payload[:4] == _DECLARE_OK:
            # queue-name (shortstr), message-count (long), consumer-count (long)
            name_end = 5 + payload[4]
            (counts[queues[len(counts)]],) = _UNSIGNED_LONG.unpack_from(payload, name_end)
        else:
            connection.on_inbound_frame(frame)
    return counts


_METHOD_FRAME = 1
_DECLARE_OK = struct.pack(">HH", *spec.Queue.DeclareOk)
_UNSIGNED_LONG = struct.Struct(">I")


@lru_cache(maxsize=4096)
def _passive_declare_arguments(queue: str) -> bytes:
    """``queue.declare(queue, passive=True)``'s arguments as ``Channel.queue_declare`` encodes them."""
    return bytes(dumps("BsbbbbbF", (0, queue, True, False, False, False, False, {})))


def publish_unconfirmed(channel: Any, message: Any, *, exchange: str, routing_key: str,
                        mandatory: bool = False, immediate: bool = False) -> None:
    """py-amqp's plain publish (``Channel._basic_publish``, 5.x) on a channel in confirm mode.

    With ``confirm_publish`` set, ``basic_publish`` waits for each ack in turn;
    a batch sends them all and waits for the acks together.
    """
    channel._basic_publish(message, exchange=exchange, routing_key=routing_key,
                           mandatory=mandatory, immediate=immediate)
