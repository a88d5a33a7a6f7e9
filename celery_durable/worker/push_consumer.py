"""Push where no turn is at stake: one RabbitMQ consumer whose credit is the worker's room, never more.

While the worker has one open queue (planning/push_turn.py) the claimer lets
the broker push it, on a channel of its own with a global ``basic.qos``. The
broker delivers while the channel's unacked messages are below the prefetch
count, so the credit is kept at ``room + delivered, unsettled and still holding
a slot``: what the broker may still send is at most the room. A message whose
run is over but not yet acked (the thread pool acks on the loop thread, after
the slot went back) is left out: the broker's count still has it, so until its
ack the broker may send one fewer, never one more. The credit moves with the room:

- a delivery takes a slot and adds an unsettled message: no change;
- an ack or reject of one of its messages while its run goes on (an early ack,
  a message given back) lowers it by one, written *before* the ack in the
  acking thread, so the broker never sees the ack first and sends one more
  than the room;
- a late ack as the run ends leaves it: the slot it frees is the room the
  broker may fill (the pool's callback gives the slot back in the same thread
  just after; a delivery that outruns it finds no slot and goes back in place);
- a run ending after an early ack frees a slot: the pass it kicks raises the credit;
- a credit of 0 cannot be said (``prefetch_count=0`` means unlimited): the
  consumer is cancelled, and a new one starts when room comes back.

A cancel asks for its ``CancelOk``; RabbitMQ sends every delivery made on the
tag before it and py-amqp dispatches frames in order, so each one still reaches
:meth:`_delivered`, which hands it to the claimer: admitted if a slot is free,
given back (rejected, requeued) if not. Nothing delivered is left without a runner.

Only where tasks ack late (``task_acks_late``, the consumer decides): then the
broker's unacked count follows the slots and the credit never moves while the
worker is full. With early acks every run lowers the credit as it starts and
raises it as it ends, and a full worker cancels the consumer and starts a new
one per run: measured (2026-12-07, interleaved A/B, 3 rounds) on RabbitMQ no-op throughput that churn cost 0.63x
(prefork -c2) and 0.76x (threads -c8) of the pipelined ``basic.get`` passes.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

from kombu.serialization import prepare_accept_content

from celery_durable.compat import amqp_push
from celery_durable.compat.amqp import supports_pipelined_gets

logger = logging.getLogger(__name__)

_tag_numbers = itertools.count(1)
_TAG_QUEUE = ":"


class PushConsumer:
    """The push consumer of one claimer; :meth:`serve` and :meth:`stop` run on the loop thread."""

    def __init__(self, connection: Any, accept: Any, room_for: Callable[[str], int],
                 on_delivery: Callable[[str, Any], None], holding: Callable[[Any], bool],
                 ending: Callable[[Any], bool]) -> None:
        self._connection = connection
        self._accept = prepare_accept_content(accept)
        #: The runs the worker may still take from a queue: min(process room, the queue's free slots).
        self._room_for = room_for
        self._on_delivery = on_delivery
        #: Whether a message's run holds a slot; whether its settlement is the run's late ack at the end.
        self._holding = holding
        self._ending = ending
        self._channel: Any = None
        # Re-entrant: a cancel waited for on the loop thread dispatches deliveries that take it again.
        self._lock = threading.RLock()
        self._queue: str | None = None
        self._tag: str | None = None
        self._credit = 0
        #: Messages delivered on this channel and not yet acked or rejected, by delivery tag.
        self._unsettled: dict[int, Any] = {}
        self.delivered = 0

    @property
    def queue(self) -> str | None:
        """The queue consumed push-style, or None in the rotated turn."""
        return self._queue

    def serve(self, queue: str) -> None:
        """Consume ``queue`` push-style, or keep doing so with the credit set to the room now."""
        if self._queue is not None and self._queue != queue:
            self.stop()
        with self._lock:
            if self._channel is None:
                self._channel = self._connection.channel()
                amqp_push.before_settle(self._channel, self._settling)
            self._queue = queue
            self._sync()

    def follow(self, queue: str | None) -> bool:
        """Consume ``queue`` push-style (planning/push_turn.py), or with None go back to the turn; whether it pushes."""
        if queue is None:
            if self._queue is not None:
                self.stop()
            return False
        self.serve(queue)
        return True

    def stop(self) -> None:
        """Back to the rotated turn: cancel, handling here what the consumer was sent before the cancel."""
        with self._lock:
            self._queue = None
            tag, self._tag = self._tag, None
        if tag is not None:
            try:
                amqp_push.cancel(self._channel, tag, wait=True)
            except Exception:  # a dead channel delivers nothing more; the broker requeues its unacked
                logger.debug("durable.push.cancel_failed", exc_info=True, extra={"event": "durable.push.cancel_failed"})

    def close(self) -> None:
        self.stop()
        channel, self._channel = self._channel, None
        if channel is not None:
            try:
                channel.close()
            except Exception:  # closing on the way out; the broker requeues
                logger.debug("durable.push.close_failed", exc_info=True, extra={"event": "durable.push.close_failed"})

    def _sync(self) -> None:
        """Write what makes the broker's credit the room (lock held): a qos, a consume or a cancel."""
        queue = self._queue
        live = sum(1 for message in self._unsettled.values() if self._holding(message))
        credit = self._room_for(queue) + live if queue is not None else 0
        if credit <= 0:
            if self._tag is not None:
                tag, self._tag = self._tag, None
                amqp_push.cancel(self._channel, tag, wait=False)
            return
        if credit != self._credit:
            amqp_push.set_prefetch(self._channel, credit)
            self._credit = credit
        if self._tag is None and queue is not None:
            # The queue rides in the tag: deliveries on a cancelled tag still name theirs.
            self._tag = f"durable-push-{next(_tag_numbers)}{_TAG_QUEUE}{queue}"
            amqp_push.consume(self._channel, queue, self._tag, self._delivered)

    def _settling(self, delivery_tag: int) -> None:
        """Before an ack or reject of one of this channel's messages is written, in the writer's thread."""
        with self._lock:
            message = self._unsettled.pop(delivery_tag, None)
            # Only a message the credit counted moves it: one whose run still holds its slot.
            if message is not None and self._holding(message) and not self._ending(message):
                self._sync()

    def _delivered(self, raw: Any) -> None:
        message = self._channel.message_to_python(raw)
        message.accept = self._accept
        with self._lock:
            self._unsettled[raw.delivery_info["delivery_tag"]] = message
        self.delivered += 1
        self._on_delivery(raw.delivery_info["consumer_tag"].split(_TAG_QUEUE, 1)[1], message)


def push_consumer_for(connection: Any, channel: Any, accept: Any, room_for: Callable[[str], int],
                      on_delivery: Callable[[str, Any], None], holding: Callable[[Any], bool],
                      ending: Callable[[Any], bool]) -> PushConsumer | None:
    """A push consumer where the claim channel is py-amqp's (RabbitMQ); None elsewhere."""
    if channel.connection.client.transport.driver_type != "amqp" or not supports_pipelined_gets(channel):
        return None
    return PushConsumer(connection, accept, room_for, on_delivery, holding, ending)
