"""The idle wait: one wait on every queue with room at once, so an idle worker picks up as fast as stock Celery.

Two ways to wait, chosen once per claim channel (:func:`idle_wait_for`, as
``fetchers.fetcher_for`` chooses the fetcher): kombu's consumers, which deliver
the first message themselves (RabbitMQ, the embedded broker, Redis without a
hub); and on Redis in Celery's event loop, a peek that takes nothing and kicks
a pass (worker/redis_idle_wait.py), with the consumers behind it for when the
peek cannot wait.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kombu.messaging import Consumer as KombuConsumer

from celery_durable.compat.amqp_watch import accepts_global_qos
from celery_durable.compat.host_types import HostChannel, HostMessage
from celery_durable.compat.transport_guards import guard_channel
from celery_durable.worker.parking import POISON_POLICY
from celery_durable.worker.redis_idle_wait import RedisIdleWait

logger = logging.getLogger(__name__)

#: Called with (queue name, message) when the wait itself took a message: the claimer admits it.
OnDelivery = Callable[[str, Any], None]


class IdleWait(Protocol):
    """Waits on many queues at once; the first message on any of them wakes the claimer."""

    @property
    def wakes(self) -> int:
        """Times a wait that only watches saw a message and kicked a pass (``idle_wakes``)."""
        ...

    def waiting_on(self) -> set[str]:
        """The queues the wait is armed on (empty when it is not armed)."""
        ...

    def arm(self, queues: Mapping[str, Any]) -> None:
        """Wait on ``queues`` (name -> kombu Queue); a wait already armed stays as it is."""
        ...

    def cancel(self) -> None:
        """Stop waiting: nothing more is taken until the next :meth:`arm`."""
        ...

    def close(self) -> None: ...


class IdleChannels:
    """Channels for the idle any-queue wait, each reused once its messages are settled.

    The idle wait consumes with a prefetch of one over the whole channel, and a
    message can only be acked on the channel it came from: a channel still
    holding an unacked run (``acks_late``) would never deliver again, so a new
    wait takes a channel whose every message is settled, or opens one.

    ``shared=False``: a prefetch of one per consumer instead, for the queues
    RabbitMQ refuses to consume on a channel with a global ``basic.qos``
    (quorum: NOT_IMPLEMENTED, which closes the whole connection). Each such
    queue may then deliver one message at once; the claimer admits what has a
    slot and gives the rest back in place.
    """

    def __init__(self, connection: Any, *, shared: bool = True) -> None:
        self._connection = connection
        self._shared = shared
        self._held: list[tuple[Any, list[Any]]] = []

    def take(self) -> tuple[Any, list[Any]]:
        for channel, messages in self._held:
            messages[:] = [m for m in messages if not m.acknowledged]
            if not messages:
                return channel, messages
        channel = guard_channel(self._connection.channel(), POISON_POLICY)
        # Global: one message across all of the wait's per-queue consumers (or one per consumer).
        channel.basic_qos(0, 1, self._shared)
        entry: tuple[Any, list[Any]] = (channel, [])
        self._held.append(entry)
        return entry

    def close(self) -> None:
        for channel, _ in self._held:
            try:
                channel.close()
            except Exception:  # closing on the way out; the broker requeues
                logger.debug("durable.idle.channel_close_failed", exc_info=True,
                             extra={"event": "durable.idle.channel_close_failed"})
        self._held.clear()


class ConsumerIdleWait:
    """kombu's consumers, one per queue on a channel with a prefetch of one: the first delivery is admitted."""

    wakes = 0  # it delivers what it sees; it never only kicks

    def __init__(self, connection: Any, accept: Any, on_delivery: OnDelivery) -> None:
        self._channels = IdleChannels(connection)
        #: Opened only for a queue that takes no global qos (RabbitMQ's quorum queues).
        self._own_prefetch_channels = IdleChannels(connection, shared=False)
        self._accept = accept
        self._on_delivery = on_delivery
        self._consumers: list[Any] = []

    def waiting_on(self) -> set[str]:
        return {queue.name for consumer in self._consumers for queue in consumer.queues}

    def arm(self, queues: Mapping[str, Any]) -> None:
        if not queues or self._consumers:
            return
        shared = {name: queue for name, queue in queues.items() if accepts_global_qos(queue.queue_arguments)}
        own = {name: queue for name, queue in queues.items() if name not in shared}
        if shared:
            self._consume(self._channels, shared)
        if own:
            self._consume(self._own_prefetch_channels, own)

    def _consume(self, channels: IdleChannels, queues: Mapping[str, Any]) -> None:
        channel, messages = channels.take()
        for name, queue in queues.items():
            consumer = KombuConsumer(
                channel,
                queues=[queue],
                accept=self._accept,
                on_message=self._delivered(name, messages),
                auto_declare=False,
            )
            consumer.consume()
            self._consumers.append(consumer)

    def _delivered(self, queue_name: str, messages: list[Any]) -> Callable[[Any], None]:
        def on_message(message: HostMessage) -> None:
            # Kept with its channel, which no new wait takes until the message is settled.
            messages.append(message)
            self._on_delivery(queue_name, message)

        return on_message

    def cancel(self) -> None:
        consumers, self._consumers = self._consumers, []
        for consumer in consumers:
            try:
                consumer.cancel()
            except Exception:  # a dead channel has nothing left to cancel
                logger.debug("durable.idle.cancel_failed", exc_info=True, extra={"event": "durable.idle.cancel_failed"})

    def close(self) -> None:
        self.cancel()
        self._channels.close()
        self._own_prefetch_channels.close()


class PeekIdleWait:
    """Redis in an event loop: the peek watches; kombu's consumers wait when it cannot.

    The peek cannot on a Redis without BLMOVE, or past its connection budget
    (worker/redis_idle_wait.py); there kombu's BRPOP consumer waits, and keeps its gap.
    """

    def __init__(self, peek: RedisIdleWait, fallback: ConsumerIdleWait) -> None:
        self._peek = peek
        self._fallback = fallback

    @property
    def wakes(self) -> int:
        return self._peek.wakes

    def waiting_on(self) -> set[str]:
        return self._peek.waiting_on | self._fallback.waiting_on()

    def arm(self, queues: Mapping[str, Any]) -> None:
        if not self._peek.arm(queues):
            self._fallback.arm(queues)

    def cancel(self) -> None:
        self._peek.disarm()
        self._fallback.cancel()

    def close(self) -> None:
        self.cancel()
        self._fallback.close()
        self._peek.close()


def idle_wait_for(connection: Any, channel: HostChannel, hub: Any, *, accept: Any, on_wake: Callable[[], None],
                  on_delivery: OnDelivery) -> IdleWait:
    """The idle wait for ``channel``'s transport: ``on_wake`` kicks a pass, ``on_delivery`` admits a message.

    ``connection`` opens the consumers' own channels; ``hub`` (Celery's event
    loop; None without one) polls the Redis peek's sockets.
    """
    consumers = ConsumerIdleWait(connection, accept, on_delivery)
    peek = RedisIdleWait.for_channel(channel, hub, on_wake)
    return consumers if peek is None else PeekIdleWait(peek, consumers)
