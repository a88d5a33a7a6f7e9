"""The RabbitMQ queue watch: queues a claim pass proved empty are consumed, so what lands there is pushed.

A worker serving many queues learns which hold work by probing them (worker/probing.py), and
trusts a queue it found empty for 20 ms before probing it again. The watch consumes those queues
instead, on a channel of its own, so a message landing on one reaches the worker at once and its
queue is never probed while it is watched. Pushing must not take more than the worker asked for,
so the channel's credit is kept at one message not yet started:

- its global ``basic.qos`` is ``1 +`` the watch's delivered messages that the claimer decided and
  that are not yet settled (raised after each decision; lowered *before* its ack or reject is
  written, in the settling thread, so the broker never sees the ack first and pushes one more).
  Every decided message counts, a run held or not (one waiting for its ETA, or for a fleet limit):
  one left out would keep the placeholder from ever taking its credit back;
- the one credit is taken by a placeholder message in a queue private to the connection
  (compat/amqp_watch.py) whenever the worker wants no push. A claim pass with room *gives* it
  (cancel the placeholder's consumer, put the placeholder back), at most every
  ``WATCH_CREDIT_EVERY`` (planning/watch_credit.py); the first message pushed takes it, and the
  placeholder's consumer starts again at once, to take the credit back when it frees.

A delivery ends the watch of its queue (the push says nothing of what else is there): the claimer
decides it (planning/watch_turn.py), and the passes ask that queue in turn until one proves it
empty again. Once the channel is open, writes only: nothing here waits for a reply, so nothing
here reads the connection (and dispatches another channel's deliveries under its caller).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from kombu.serialization import prepare_accept_content

from celery_durable.clock import Clock
from celery_durable.compat import amqp_push, amqp_watch
from celery_durable.compat.amqp import supports_pipelined_gets
from celery_durable.planning.watch_credit import may_give_credit

logger = logging.getLogger(__name__)

_tag_numbers = itertools.count(1)
_TAG_QUEUE = ":"


class QueueWatch:
    """The watch of one claimer. Runs on the loop thread, but for the settle hook (any thread that acks)."""

    def __init__(self, connection: Any, accept: Any, on_delivery: Callable[[str, Any], None], clock: Clock) -> None:
        self._connection = connection
        self._accept = prepare_accept_content(accept)
        self._on_delivery = on_delivery
        self._clock = clock
        self._channel: Any = None
        # Re-entrant: the settle hook runs inside a give-back written under it.
        self._lock = threading.RLock()
        self._placeholder_queue = ""
        #: The placeholder's consumer; None while the credit is given.
        self._placeholder_consumer: str | None = None
        #: The placeholder's delivery tag while it holds the credit; None while given or on its way.
        self._placeholder_held: int | None = None
        self._given_at: float | None = None
        #: Watched queue -> its consumer tag.
        self._watched: dict[str, str] = {}
        #: ``_watched``'s names, made once per change: every pass asks for them (twice), and a set of
        #: 200 names made per pass is a cost the watch exists to save.
        self._watched_names: frozenset[str] = frozenset()
        #: Messages delivered and not yet acked or rejected, and the ones of those decided (the credit counts them).
        self._unsettled: dict[int, Any] = {}
        self._counted: set[int] = set()
        self._prefetch = 0
        self.delivered = 0
        self.credits_given = 0

    # -- what the claimer asks ------------------------------------------------------
    def watched(self) -> frozenset[str]:
        return self._watched_names

    @property
    def holds_credit(self) -> bool:
        """Whether the placeholder holds the credit (nothing can be pushed until a pass gives it)."""
        return self._placeholder_held is not None

    def watch(self, queues: Iterable[str]) -> None:
        """Consume ``queues`` (not already watched); the placeholder keeps the credit until a pass gives it."""
        with self._lock:
            self._open()
            for queue in queues:
                if queue in self._watched:
                    continue
                # The queue rides in the tag: a delivery on a cancelled tag still names its queue.
                tag = f"durable-watch-{next(_tag_numbers)}{_TAG_QUEUE}{queue}"
                self._watched[queue] = tag
                amqp_push.consume(self._channel, queue, tag, self._delivered)
            self._watched_names = frozenset(self._watched)

    def give(self) -> bool:
        """Let the broker push one message (a pass with room); False if the credit is not the watch's to give now.

        The consumer is cancelled before the placeholder goes back: RabbitMQ takes a channel's methods
        in order, so the placeholder is not redelivered to it, and neither write waits for a reply.
        """
        with self._lock:
            held = self._placeholder_held
            now = self._clock.monotonic()
            if held is None or not self._watched or not may_give_credit(self._given_at, now):
                return False
            consumer, self._placeholder_consumer, self._placeholder_held = self._placeholder_consumer, None, None
            if consumer is not None:
                amqp_push.cancel(self._channel, consumer, wait=False)
            amqp_watch.reject_placeholder(self._channel, held)
            self._given_at = now
            self.credits_given += 1
            return True

    def decided(self, message: Any) -> None:
        """The claimer admitted ``message``: if it is still unsettled, the credit makes room beside it."""
        with self._lock:
            tag = message.delivery_tag
            if tag in self._unsettled and tag not in self._counted:
                self._counted.add(tag)
                self._write_credit()

    def give_back(self, message: Any) -> None:
        """Put a delivered message back in its queue, in place (``redelivered`` is set on it)."""
        message.reject(requeue=True)

    def unwatch_all(self) -> None:
        """Stop consuming every watched queue (a stop, the queues changed); deliveries already sent still come."""
        with self._lock:
            watched, self._watched = self._watched, {}
            self._watched_names = frozenset()
            for tag in watched.values():
                try:
                    amqp_push.cancel(self._channel, tag, wait=False)
                except Exception:  # a dead channel delivers nothing more; the broker requeues its unacked
                    logger.debug("durable.watch.cancel_failed", exc_info=True,
                                 extra={"event": "durable.watch.cancel_failed"})

    def close(self) -> None:
        self.unwatch_all()
        channel, self._channel = self._channel, None
        if channel is not None:
            try:
                channel.close()
            except Exception:  # closing on the way out; the broker requeues, the connection takes the queue
                logger.debug("durable.watch.close_failed", exc_info=True, extra={"event": "durable.watch.close_failed"})

    # -- the channel -------------------------------------------------------------------
    def _open(self) -> None:
        if self._channel is not None:
            return
        channel = self._connection.channel()
        amqp_push.before_settle(channel, self._settling)
        self._placeholder_queue = amqp_watch.declare_placeholder(channel)
        self._channel = channel
        self._write_credit()
        self._take_credit()

    def _write_credit(self) -> None:
        """The channel's credit: one message not yet started, beside the held runs' (lock held)."""
        prefetch = 1 + len(self._counted)
        if prefetch != self._prefetch and self._channel is not None:
            amqp_push.set_prefetch(self._channel, prefetch)
            self._prefetch = prefetch

    def _take_credit(self) -> None:
        """Consume the placeholder's queue: the placeholder takes the credit as soon as it is free (lock held)."""
        tag = f"durable-watch-{next(_tag_numbers)}{_TAG_QUEUE}"
        self._placeholder_consumer = tag
        amqp_push.consume(self._channel, self._placeholder_queue, tag, self._placeholder_delivered)

    def _placeholder_delivered(self, raw: Any) -> None:
        with self._lock:
            self._placeholder_held = raw.delivery_info["delivery_tag"]

    def _delivered(self, raw: Any) -> None:
        message = self._channel.message_to_python(raw)
        message.accept = self._accept
        queue = raw.delivery_info["consumer_tag"].split(_TAG_QUEUE, 1)[1]
        with self._lock:
            self._unsettled[raw.delivery_info["delivery_tag"]] = message
            if self._placeholder_consumer is None:
                # It took the credit that was given: the placeholder takes the next one that frees.
                self._take_credit()
            if self._watched.get(queue) == raw.delivery_info["consumer_tag"]:
                # What else is there the push does not say: the passes ask the queue from now on. Cancelled
                # before the claimer may give the message back, so it is not pushed here again.
                del self._watched[queue]
                self._watched_names = frozenset(self._watched)
                amqp_push.cancel(self._channel, raw.delivery_info["consumer_tag"], wait=False)
        self.delivered += 1
        self._on_delivery(queue, message)

    def _settling(self, delivery_tag: int) -> None:
        """Before an ack or reject of one of this channel's messages is written, in the writer's thread."""
        with self._lock:
            self._unsettled.pop(delivery_tag, None)
            if delivery_tag in self._counted:
                self._counted.discard(delivery_tag)
                self._write_credit()


def queue_watch_for(connection: Any, channel: Any, accept: Any, on_delivery: Callable[[str, Any], None],
                    clock: Clock) -> QueueWatch | None:
    """A queue watch where the claim channel is py-amqp's (RabbitMQ); None elsewhere."""
    if channel.connection.client.transport.driver_type != "amqp" or not supports_pipelined_gets(channel):
        return None
    return QueueWatch(connection, accept, on_delivery, clock)
