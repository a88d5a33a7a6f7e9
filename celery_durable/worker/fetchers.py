"""How one ask takes messages from a queue: about one broker round trip per ask on Redis and AMQP."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from time import time
from typing import Any, Protocol, runtime_checkable

from kombu.serialization import prepare_accept_content

from celery_durable.compat import redis_acks, redis_claim
from celery_durable.compat.amqp import pipelined_gets, pipelined_ready_counts, supports_pipelined_gets
from celery_durable.compat.host_types import HostChannel, HostMessage, RedisChannel
from celery_durable.compat.redis_channel import channel_client, channel_qos, is_redis
from celery_durable.compat.transport_guards import guard_channel
from celery_durable.headers import PARKED_SUFFIX
from celery_durable.leases.keeper import keeper
from celery_durable.worker.parking import (
    POISON_POLICY,
    envelope,
    log_parked,
    park_redis_items,
)

logger = logging.getLogger(__name__)


class Fetcher(Protocol):
    @property
    def round_trips(self) -> int:
        """Broker round trips this fetcher's claims made (``claim_round_trips`` in inspect stats)."""
        ...

    def fetch(self, queue: Any, count: int, keep_going: Callable[[], bool]) -> Iterator[Any]:
        """Yield at most ``count`` messages from ``queue``, each held unacked by this worker."""
        ...


@dataclass(frozen=True)
class PassAsk:
    """One ask of a pass a broker ran whole: what was asked, how many the broker took, those readable."""

    queue: str
    count: int
    taken: int
    messages: list[Any]


@runtime_checkable
class ProbingFetcher(Fetcher, Protocol):
    """A fetcher that can learn, in about one round trip, which of many queues hold ready messages."""

    def ready_counts(self, queues: Sequence[str]) -> dict[str, int]: ...

    def remaining(self) -> int | None:
        """The ready messages the last fetch left in its queue (its last ``GetOk``'s count), None if it took none."""
        ...


@runtime_checkable
class PassFetcher(Fetcher, Protocol):
    """A fetcher that runs a whole claim pass in one broker round trip."""

    def claim_pass(self, order: Sequence[str], free: Mapping[str, int], room: int | None) -> list[PassAsk]:
        """Run the sweep over ``order`` (already rotated) server-side; the asks that took messages, in order."""
        ...


@runtime_checkable
class NotifyingFetcher(PassFetcher, Protocol):
    """A pass fetcher whose broker says which queues got rows, so a pass may leave out the ones known empty."""

    def notified(self) -> set[str] | None:
        """The queues that got rows since the last call, or None if the broker may not have said so for all."""
        ...


@runtime_checkable
class AckCarrier(PassFetcher, Protocol):
    """A pass fetcher whose pass can carry the acks made while it was coming (one round trip for both)."""

    def carry_acks(self, pass_coming: Callable[[], bool]) -> None:
        """From now on, an ack made on this thread while ``pass_coming()`` rides in that pass."""
        ...

    def send_acks(self) -> None:
        """Send at once, on their own, the acks no pass carried."""
        ...


class GetFetcher:
    """Any kombu transport: one ``basic_get`` per message (AMQP, the SQLAlchemy broker)."""

    def __init__(self, channel: HostChannel, accept: Any) -> None:
        self._channel = channel
        self._accept = prepare_accept_content(accept)
        self.round_trips = 0

    def fetch(self, queue: Any, count: int, keep_going: Callable[[], bool]) -> Iterator[Any]:
        channel = self._channel
        taken = 0
        while taken < count and keep_going():
            self.round_trips += 1
            # kombu's Queue.get, without its re-raise of a decompression error:
            # the claimer parks such a message instead of dying of it.
            raw = channel.basic_get(queue=queue.name, no_ack=False)
            if raw is None:
                return
            message = channel.message_to_python(raw) if hasattr(channel, "message_to_python") else raw
            message.accept = self._accept
            taken += 1
            yield message


class RedisFetcher:
    """Redis: one script call per pass takes what the pass asks of every queue and marks it unacked."""

    def __init__(self, channel: RedisChannel, accept: Any, held_key: str | None = None) -> None:
        self._channel = channel
        self._accept = prepare_accept_content(accept)
        #: This worker's held set (worker/redis_restore.py): every tag claimed is recorded there too.
        self._held_key = held_key
        self._pass_script: Any = None
        self._client: Any = None
        self.round_trips = 0
        #: Tags acked in the channel's memory whose Redis half rides with the pass coming.
        self._acks: list[Any] = []
        self._loop_thread: int | None = None
        self._pass_coming: Callable[[], bool] = lambda: False

    def carry_acks(self, pass_coming: Callable[[], bool]) -> None:
        """Let an ack made on this (the loop's) thread while ``pass_coming()`` ride in that pass.

        Called on the thread the claim passes run on. Celery runs a late ack
        there (``Consumer.call_soon_ack``: the hub's next round), after the
        result callback that freed the run's slot kicked a pass: that pass
        carries it. An ack on another thread, or with no pass coming, goes to
        Redis at once, as kombu sends it.
        """
        self._loop_thread = threading.get_ident()
        self._pass_coming = pass_coming
        redis_acks.defer_acks(self._channel, self._defer_ack)

    def _defer_ack(self, tag: Any) -> bool:
        if threading.get_ident() != self._loop_thread or not self._pass_coming():
            return False
        self._acks.append(tag)
        return True

    def send_acks(self) -> None:
        if not self._acks:
            return
        tags, self._acks = self._acks, []
        try:
            redis_acks.send_acks(self._channel, self._redis(), tags, self._held_key)
        except Exception as exc:
            # Any error, not only a connection error: this runs in the claimer's stop, and a channel closed
            # under it raises AttributeError (kombu). As a late ack on a lost connection today, the records
            # stay, and the run's copy is a duplicate the run's lease (or settled state) makes a no-op.
            logger.warning("durable.redis.ack_failed acks=%d error=%s", len(tags), exc, exc_info=True,
                           extra={"event": "durable.redis.ack_failed", "acks": len(tags), "error": repr(exc)})

    def _redis(self) -> Any:
        """A client on the channel's connection pool, made once: making one per pass cost ~5 % of a pass."""
        if self._client is None:
            with channel_client(self._channel) as client:
                self._client = client
        return self._client

    def fetch(self, queue: Any, count: int, keep_going: Callable[[], bool]) -> Iterator[Any]:
        """An ask of one queue: a pass over it alone (one script call)."""
        wanted = count
        while wanted > 0:
            asks = self.claim_pass([queue.name], {queue.name: wanted}, wanted)
            taken = sum(ask.taken for ask in asks)
            messages = [message for ask in asks for message in ask.messages]
            yield from messages
            # An item the script took but Python could not read (a body that
            # is not base64) was parked and cost the ask a message: ask again
            # for what it cost, unless the queue ran dry. Only poison costs a
            # second round trip.
            wanted = wanted - len(messages) if taken == wanted and keep_going() else 0

    def claim_pass(self, order: Sequence[str], free: Mapping[str, int], room: int | None) -> list[PassAsk]:
        channel = self._channel
        queues = list(order)
        client = self._redis()
        if self._pass_script is None:
            self._pass_script = redis_claim.register_pass(client)
        self.round_trips += 1
        acks, self._acks = self._acks, []
        try:
            asks, parked = redis_claim.claim_pass(channel, client, self._pass_script, queues, PARKED_SUFFIX,
                                                  [free[q] for q in queues], room, time(), self._held_key, acks)
        except BaseException:
            self._acks = acks + self._acks  # not carried: send_acks tries them on their own
            raise
        for queue, raw in parked:
            log_parked(queue, raw, "not a kombu message: not JSON, or no properties, "
                       "string delivery_tag or delivery_info")
        results: list[PassAsk] = []
        for queue, count, items, tags in asks:
            messages = _readable(channel, client, queue, items, tags)
            for message in messages:
                redis_claim.record_unacked(channel, message)
                message.accept = self._accept
            results.append(PassAsk(queue, count, len(items), messages))
        return results


class PgFetcher:
    """``durable+postgresql://``: the claim sweep runs in the database (``durable_broker_claim_pass``)."""

    def __init__(self, channel: Any, accept: Any) -> None:
        self._channel = channel
        self._rows = channel.rows
        # The worker's lease keeper renews the rows this worker holds, beside its runs and limits:
        # one heartbeat per worker, not the transport's thread as well.
        self._rows.beat_with(keeper())
        self._accept = prepare_accept_content(accept)
        self.round_trips = 0

    def fetch(self, queue: Any, count: int, keep_going: Callable[[], bool]) -> Iterator[HostMessage]:
        """An ask of one queue: a pass over it alone (one statement)."""
        wanted = count
        while wanted > 0:
            asks = self.claim_pass([queue.name], {queue.name: wanted}, wanted)
            taken = sum(ask.taken for ask in asks)
            messages = [message for ask in asks for message in ask.messages]
            yield from messages
            # A row the claim parked (not a kombu message) cost the ask one: ask again for it,
            # unless the queue ran dry. Only poison costs a second statement.
            wanted = wanted - len(messages) if taken == wanted and keep_going() else 0

    def notified(self) -> set[str] | None:
        # The transport's LISTEN connection: each INSERT NOTIFYs its queue (read here, in the claimer's thread).
        notified: set[str] | None = self._rows.take_notified()
        return notified

    def claim_pass(self, order: Sequence[str], free: Mapping[str, int], room: int | None) -> list[PassAsk]:
        queues = list(order)
        self.round_trips += 1
        results: list[PassAsk] = []
        for queue, count, taken, payloads in self._rows.claim_pass(queues, [free[q] for q in queues], room):
            messages = []
            for payload in payloads:
                message = self._channel.adopt(payload)
                message.accept = self._accept
                messages.append(message)
            results.append(PassAsk(queue, count, taken, messages))
        return results


def _readable(channel: RedisChannel, client: Any, queue: str, items: list[Any], tags: list[Any]) -> list[Any]:
    """The claimed items Python can read as messages; the others (a body not base64) are parked at once."""
    messages = []
    poison: list[tuple[Any, Any, str]] = []
    for raw, tag in zip(items, tags):
        message, reason = envelope(channel, raw)
        if message is None:
            poison.append((raw, tag, reason or "not a kombu message"))
        else:
            messages.append(message)
    if poison:
        park_redis_items(client, channel_qos(channel), queue, poison)
    return messages


class AmqpFetcher:
    """AMQP: an ask for n writes n ``basic.get`` at once, then reads the n replies in order.

    One ``basic.get`` per message costs a full broker round trip each; AMQP
    answers a channel's methods in order, so n pipelined gets cost about one.
    """

    def __init__(self, channel: HostChannel, accept: Any) -> None:
        self._channel = channel
        self._accept = prepare_accept_content(accept)
        self._single = GetFetcher(channel, accept)
        self._pipelined_round_trips = 0
        self._remaining: int | None = None

    @property
    def round_trips(self) -> int:
        return self._single.round_trips + self._pipelined_round_trips

    def ready_counts(self, queues: Sequence[str]) -> dict[str, int]:
        """Ready messages per queue: a passive declare of each, pipelined (about one round trip)."""
        self._pipelined_round_trips += 1
        return pipelined_ready_counts(self._channel, list(queues))

    def remaining(self) -> int | None:
        return self._remaining

    def fetch(self, queue: Any, count: int, keep_going: Callable[[], bool]) -> Iterator[Any]:
        self._remaining = None
        if count < 2:
            for message in self._single.fetch(queue, count, keep_going):
                self._remaining = message.delivery_info.get("message_count")
                yield message
            return
        channel = self._channel
        # Every reply is read before any message is handed on, even if a stop
        # comes meanwhile: an unread GetOk would leave a message unacked on
        # this channel with nobody holding it.
        self._pipelined_round_trips += 1
        raws = pipelined_gets(channel, queue.name, count)
        if raws:
            self._remaining = raws[-1].delivery_info.get("message_count")
        for raw in raws:
            message = channel.message_to_python(raw)
            message.accept = self._accept
            yield message


def gives_back_in_place(channel: HostChannel) -> bool:
    """Whether a message taken on ``channel`` and given back goes ahead of the ones sent after it.

    Redis: restored to the head of its list (``compat.redis_claim.restore_in_front``); RabbitMQ: a
    rejected message is requeued in its place; the PostgreSQL broker (driver ``durable``) clears the
    row's holder, its id kept. kombu's other virtual transports (the SQLAlchemy broker) put it back
    as a new message, behind the rest: a pass there takes no more than its room, or a key's messages
    given back would run after its newer ones.
    """
    return channel.connection.client.transport.driver_type in ("redis", "amqp", "durable")


def give_back_in_place(messages: list[Any]) -> None:
    """Put claimed messages of a transport that ``gives_back_in_place`` back ahead of newer ones.

    Redis restores them to the head of their lists (kombu's requeue would put
    them at the tail, behind newer messages); RabbitMQ requeues a rejected
    message in its place, and so does the PostgreSQL broker.
    """
    if messages[0].channel.connection.client.transport.driver_type == "redis":
        redis_claim.restore_in_front(messages)
    else:
        for message in messages:
            message.reject(requeue=True)


def fetcher_for(channel: HostChannel, accept: Any, held_key: str | None = None) -> Fetcher:
    """The fetcher for ``channel``'s transport; the channel's own reads get their poison guard.

    ``held_key``: on Redis, the held set this worker's claims are recorded in (its liveness).
    """
    guard_channel(channel, POISON_POLICY)
    if is_redis(channel):
        return RedisFetcher(channel, accept, held_key)
    driver = channel.connection.client.transport.driver_type
    if driver == "amqp" and supports_pipelined_gets(channel):
        return AmqpFetcher(channel, accept)
    if driver == "durable":
        return PgFetcher(channel, accept)
    return GetFetcher(channel, accept)
