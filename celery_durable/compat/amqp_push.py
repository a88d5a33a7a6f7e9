"""py-amqp below kombu: a push consumer whose credit the worker sets from any thread, without waiting for replies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from amqp import spec


def set_prefetch(channel: Any, count: int) -> None:
    """``basic.qos(prefetch_count=count, global=True)``, written without waiting for its ``QosOk``.

    ``Channel.basic_qos`` waits for the reply, which only the loop thread may
    read (a pool thread that acks must lower the credit first, see
    worker/push_consumer.py). The ``QosOk`` read later has no listener and
    py-amqp's ``dispatch_method`` drops it (py-amqp 5.x ``abstract_channel.py``).
    Global: RabbitMQ applies a per-consumer qos only to consumers made after it.
    """
    channel.send_method(spec.Basic.Qos, "lBb", (0, count, True))


def consume(channel: Any, queue: str, consumer_tag: str, on_delivery: Callable[[Any], None]) -> None:
    """``basic.consume`` with ``nowait``: the callback is registered before the frame goes out.

    ``Channel.basic_consume(nowait=True)`` registers it after writing, so a
    delivery read meanwhile by another thread would find no callback and be
    rejected. Each delivery reaches ``on_delivery`` as py-amqp's raw message.
    """
    channel.callbacks[consumer_tag] = on_delivery
    channel.send_method(spec.Basic.Consume, "BssbbbbF", (0, queue, consumer_tag, False, False, False, True, {}))


def cancel(channel: Any, consumer_tag: str, *, wait: bool) -> None:
    """``basic.cancel`` asking for its ``CancelOk``; ``wait``: read it here (the loop thread only).

    The broker sends every delivery made on the tag before its ``CancelOk``,
    and py-amqp dispatches frames in order: each one reaches the tag's callback,
    and py-amqp's own ``_on_basic_cancel_ok`` removes the callback when the
    ``CancelOk`` comes (py-amqp 5.x ``channel.py``). Not waiting (a pool thread
    must not read the socket), the loop's next drain reads it.
    """
    channel.send_method(spec.Basic.Cancel, "sb", (consumer_tag, False),
                        wait=spec.Basic.CancelOk if wait else None)


def before_settle(channel: Any, hook: Callable[[int], None]) -> None:
    """Call ``hook(delivery_tag)`` before every ack or reject written on ``channel``, in the writer's thread.

    kombu's ``Message.ack``/``reject``/``requeue`` call the channel's
    ``basic_ack``/``basic_reject``: overriding them on this one channel object
    sees every settlement of a message it delivered, whoever writes it.
    """
    ack, reject = channel.basic_ack, channel.basic_reject

    def basic_ack(delivery_tag: int, multiple: bool = False, *args: Any, **kwargs: Any) -> Any:
        hook(delivery_tag)
        return ack(delivery_tag, multiple, *args, **kwargs)

    def basic_reject(delivery_tag: int, requeue: bool, *args: Any, **kwargs: Any) -> Any:
        hook(delivery_tag)
        return reject(delivery_tag, requeue, *args, **kwargs)

    channel.basic_ack = basic_ack
    channel.basic_reject = basic_reject
