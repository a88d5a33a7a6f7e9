"""kombu's publish path below ``Producer.publish``, where the outbox relay batches a whole claim.

Two kombu 5.7 seams, both private and both feature-detected (older kombu
publishes one message at a time, correctly, just slower):

- ``Producer._batch_local.current``: while set, ``Producer._publish`` hands a
  prepared message to it instead of ``channel.basic_publish`` — the one seam
  after declarations and serialization and before any broker write;
- the Redis channel's ``_inplace_augment_message`` and ``_put(..., _publish_batch=)``:
  the commands kombu would run to store a message, recorded instead of run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class PublishSink(Protocol):
    def publish(self, channel: Any, message: Any, **publish_kwargs: Any) -> None: ...


def producer_batch_seam_free(producer: Any) -> bool:
    """kombu >= 5.7, and no ``Producer.batch()`` open on this producer."""
    local = getattr(producer, "_batch_local", None)
    return local is not None and getattr(local, "current", None) is None


@contextmanager
def producer_publishes_to(producer: Any, sink: PublishSink) -> Iterator[None]:
    """While open, every message ``producer`` prepares goes to ``sink.publish`` instead of the broker."""
    local = producer._batch_local
    local.current = sink
    try:
        yield
    finally:
        del local.current


def redis_batch_supported(channel: Any) -> bool:
    """kombu's Redis channel has the publish-batch hook (5.7+) and redis-py will not replay a pipeline."""
    # supports_batch_publish is False when redis-py would replay a pipeline on
    # a timeout, which could run a whole EXEC twice.
    return (hasattr(channel, "create_publish_batch") and hasattr(channel, "_inplace_augment_message")
            and bool(getattr(channel, "supports_batch_publish", False)))


class CommandSink(Protocol):
    def add(self, name: str, *args: Any) -> None: ...


def record_redis_put(channel: Any, message: Any, exchange: str, routing_key: str,
                     queues: Iterable[str], sink: CommandSink) -> None:
    """Add to ``sink`` the commands kombu's Redis ``basic_publish`` would run to store ``message`` on ``queues``."""
    channel._inplace_augment_message(message, exchange, routing_key)
    for queue in queues:
        channel._put(queue, message, _publish_batch=sink)
