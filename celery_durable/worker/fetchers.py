"""How one ask takes messages from a queue: about one broker round trip per ask on Redis and AMQP."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from time import time
from typing import Any, Protocol

from kombu.serialization import prepare_accept_content
from kombu.transport import virtual

from celery_durable.worker.parking import envelope, log_parked, park_redis_items, parked_name
from celery_durable.worker.transport_guards import guard_channel


class Fetcher(Protocol):
    def fetch(self, queue: Any, count: int, keep_going: Callable[[], bool]) -> Iterator[Any]:
        """Yield at most ``count`` messages from ``queue``, each held unacked by this worker."""
        ...


class GetFetcher:
    """Any kombu transport: one ``basic_get`` per message (AMQP, the SQLAlchemy broker)."""

    def __init__(self, channel: Any, accept: Any) -> None:
        self._channel = channel
        self._accept = prepare_accept_content(accept)

    def fetch(self, queue: Any, count: int, keep_going: Callable[[], bool]) -> Iterator[Any]:
        channel = self._channel
        taken = 0
        while taken < count and keep_going():
            # kombu's Queue.get, without its re-raise of a decompression error:
            # the claimer parks such a message instead of dying of it.
            raw = channel.basic_get(queue=queue.name, no_ack=False)
            if raw is None:
                return
            message = channel.message_to_python(raw) if hasattr(channel, "message_to_python") else raw
            message.accept = self._accept
            taken += 1
            yield message


# Pops up to ARGV[1] messages from the queue's priority lists (KEYS[4..], in
# kombu's order) and records each in the unacked index and hash (KEYS[1],
# KEYS[2]) in the format kombu's restore reads: [payload, exchange, routing_key].
# kombu's own get does the pop and the unacked write in two round trips and not
# atomically (a crash between them loses the message); this does one, atomically.
# An item that is not a kombu message (not JSON, or no properties, string
# delivery_tag or delivery_info) goes to the parked list KEYS[3] and the loop
# goes on: one poison item must neither fail the script (the worker would
# exit, and good items popped before it would sit unacked) nor cost the ask.
# Returns {items, their delivery tags, parked items}.
_CLAIM_LUA = """
local want = tonumber(ARGV[1])
local now = ARGV[2]
local out = {}
local tags = {}
local parked = {}
for i = 4, #KEYS do
  while #out < want do
    local item = redis.call('RPOP', KEYS[i])
    if not item then break end
    local ok, msg = pcall(cjson.decode, item)
    local props = ok and type(msg) == 'table' and msg['properties']
    local info = type(props) == 'table' and props['delivery_info']
    local tag = type(props) == 'table' and props['delivery_tag']
    if type(info) == 'table' and type(tag) == 'string' then
      redis.call('ZADD', KEYS[1], now, tag)
      redis.call('HSET', KEYS[2], tag,
        '[' .. item .. ',' .. cjson.encode(info['exchange']) .. ',' .. cjson.encode(info['routing_key']) .. ']')
      out[#out + 1] = item
      tags[#tags + 1] = tag
    else
      redis.call('LPUSH', KEYS[3], item)
      parked[#parked + 1] = item
    end
  end
  if #out >= want then break end
end
return {out, tags, parked}
"""


class RedisFetcher:
    """Redis: one script call per ask takes up to ``count`` messages and marks them unacked."""

    def __init__(self, channel: Any, accept: Any) -> None:
        self._channel = channel
        self._accept = prepare_accept_content(accept)
        self._script: Any = None

    def fetch(self, queue: Any, count: int, keep_going: Callable[[], bool]) -> Iterator[Any]:
        wanted = count
        while wanted > 0:
            items, messages = self._claim(queue, wanted)
            yield from messages
            # An item the script took but Python could not read (a body that
            # is not base64) was parked and cost the ask a message: ask again
            # for what it cost, unless the queue ran dry. Only poison costs a
            # second round trip.
            wanted = wanted - len(messages) if items == wanted and keep_going() else 0

    def _claim(self, queue: Any, count: int) -> tuple[int, list[Any]]:
        """One script call: how many items it took as messages, and those Python could read."""
        channel = self._channel
        qos = channel.qos
        keys = [qos.unacked_index_key, qos.unacked_key, parked_name(queue.name),
                *(channel._q_for_pri(queue.name, pri) for pri in channel.priority_steps)]
        with channel.conn_or_acquire() as client:
            if self._script is None:
                self._script = client.register_script(_CLAIM_LUA)
            items, tags, parked = self._script(keys=keys, args=[count, repr(time())], client=client)
            # kombu refreshes a queue's x-expires on each get; a no-op without one.
            channel._maybe_update_queues_expire(client, queue.name)
            messages = []
            poison: list[tuple[Any, Any, str]] = []
            for raw, tag in zip(items, tags):
                message, reason = envelope(channel, raw)
                if message is None:
                    poison.append((raw, tag, reason or "not a kombu message"))
                else:
                    messages.append(message)
            if poison:
                park_redis_items(client, qos, queue.name, poison)
        for raw in parked:
            log_parked(queue.name, raw, "not a kombu message: not JSON, or no properties, "
                       "string delivery_tag or delivery_info")
        for message in messages:
            # The script wrote the Redis side; this is the channel's own record,
            # which its ack/reject/restore read.
            virtual.QoS.append(qos, message, message.delivery_tag)
            message.accept = self._accept
        return len(items), messages


class AmqpFetcher:
    """AMQP: an ask for n writes n ``basic.get`` at once, then reads the n replies in order.

    One ``basic.get`` per message costs a full broker round trip each; AMQP
    answers a channel's methods in order, so n pipelined gets cost about one.
    """

    def __init__(self, channel: Any, accept: Any) -> None:
        self._channel = channel
        self._accept = prepare_accept_content(accept)
        self._single = GetFetcher(channel, accept)

    def fetch(self, queue: Any, count: int, keep_going: Callable[[], bool]) -> Iterator[Any]:
        if count < 2:
            yield from self._single.fetch(queue, count, keep_going)
            return
        from amqp import spec

        channel = self._channel
        for _ in range(count):
            channel.send_method(spec.Basic.Get, "Bsb", (0, queue.name, False))
        # Every reply is read before any message is handed on, even if a stop
        # comes meanwhile: an unread GetOk would leave a message unacked on
        # this channel with nobody holding it.
        replies = [channel.wait([spec.Basic.GetOk, spec.Basic.GetEmpty], returns_tuple=True)
                   for _ in range(count)]
        for reply in replies:
            if not reply or len(reply) < 2:
                continue  # GetEmpty
            message = channel.message_to_python(channel._on_get_ok(*reply))
            message.accept = self._accept
            yield message


def fetcher_for(channel: Any, accept: Any) -> Fetcher:
    """The fetcher for ``channel``'s transport; the channel's own reads get their poison guard."""
    guard_channel(channel)
    driver = channel.connection.client.transport.driver_type
    if driver == "redis":
        return RedisFetcher(channel, accept)
    if driver == "amqp" and hasattr(channel, "send_method"):
        return AmqpFetcher(channel, accept)
    return GetFetcher(channel, accept)
