"""py-amqp below kombu: the RabbitMQ queue watch's placeholder, the message that holds its one credit.

RabbitMQ cannot be told "push nothing" (``prefetch_count=0`` means unlimited), so the watch's
channel keeps a credit of one more than its running runs, and one message of its own takes that
credit whenever the worker does not want a push: the placeholder, alone in a queue private to the
worker's connection.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from amqp import Message, spec

#: The queue types that accept a consumer on a channel with a global ``basic.qos``. Quorum and stream
#: queues refuse it with a connection-level NOT_IMPLEMENTED (every channel of the connection dies):
#: those stay probed.
GLOBAL_QOS_QUEUE_TYPES = frozenset({"classic"})


def accepts_global_qos(queue_arguments: Mapping[str, Any] | None) -> bool:
    """Whether a queue declared with ``queue_arguments`` may be consumed on the watch's channel."""
    queue_type = (queue_arguments or {}).get("x-queue-type", "classic")
    return queue_type in GLOBAL_QOS_QUEUE_TYPES


def declare_placeholder(channel: Any) -> str:
    """Declare the placeholder's queue on ``channel`` and put the one placeholder message in it; its name.

    Server-named and exclusive: it belongs to this connection and goes with it. Not auto-delete:
    an auto-delete queue is deleted when its last consumer is cancelled, which giving the credit
    does (RabbitMQ then answered the next consume with ``404 NOT_FOUND``).
    """
    name, _, _ = channel.queue_declare(queue="", exclusive=True, auto_delete=False, durable=False)
    channel.basic_publish(Message(b"", delivery_mode=1), exchange="", routing_key=name)
    return str(name)


def reject_placeholder(channel: Any, delivery_tag: int) -> None:
    """Put the placeholder back in its queue (``basic.reject`` with requeue), without the settle hook.

    Written as a frame: the channel's ``basic_reject`` is wrapped to lower the credit of a run's
    message (compat/amqp_push.py ``before_settle``), which the placeholder is not.
    """
    channel.send_method(spec.Basic.Reject, "Lb", (delivery_tag, True))
