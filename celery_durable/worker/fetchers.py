"""How one ask takes messages from a queue: about one broker round trip per ask on Redis and AMQP."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from time import time
from typing import Any, Protocol

from kombu.serialization import prepare_accept_content
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str


class Fetcher(Protocol):
    def fetch(self, queue: Any, count: int, keep_going: Callable[[], bool]) -> Iterator[Any]:
        """Yield at most ``count`` messages from ``queue``, each held unacked by this worker."""
        ...


class GetFetcher:
    """Any kombu transport: one ``basic_get`` per message (AMQP, the SQLAlchemy broker)."""

    def __init__(self, channel: Any, accept: Any) -> None:
        self._channel = channel
        self._accept = accept
        self._bound: dict[str, Any] = {}

    def fetch(self, queue: Any, count: int, keep_going: Callable[[], bool]) -> Iterator[Any]:
        bound = self._bound.get(queue.name)
        if bound is None or bound.channel is not self._channel:
            bound = self._bound[queue.name] = queue(self._channel)
        taken = 0
        while taken < count and keep_going():
            message = bound.get(no_ack=False, accept=self._accept)
            if message is None:
                return
            taken += 1
            yield message


# Pops up to ARGV[1] messages from the queue's priority lists (KEYS[3..], in
# kombu's order) and records each in the unacked index and hash (KEYS[1],
# KEYS[2]) in the format kombu's restore reads: [payload, exchange, routing_key].
# kombu's own get does the pop and the unacked write in two round trips and not
# atomically (a crash between them loses the message); this does one, atomically.
_CLAIM_LUA = """
local want = tonumber(ARGV[1])
local now = ARGV[2]
local out = {}
for i = 3, #KEYS do
  while #out < want do
    local item = redis.call('RPOP', KEYS[i])
    if not item then break end
    local props = cjson.decode(item)['properties']
    local info = props['delivery_info']
    local tag = props['delivery_tag']
    redis.call('ZADD', KEYS[1], now, tag)
    redis.call('HSET', KEYS[2], tag,
      '[' .. item .. ',' .. cjson.encode(info['exchange']) .. ',' .. cjson.encode(info['routing_key']) .. ']')
    out[#out + 1] = item
  end
  if #out >= want then break end
end
return out
"""


class RedisFetcher:
    """Redis: one script call per ask takes up to ``count`` messages and marks them unacked."""

    def __init__(self, channel: Any, accept: Any) -> None:
        self._channel = channel
        self._accept = prepare_accept_content(accept)
        self._fallback = GetFetcher(channel, accept)
        self._script: Any = None

    def fetch(self, queue: Any, count: int, keep_going: Callable[[], bool]) -> Iterator[Any]:
        if queue.expires is not None:
            # kombu refreshes a queue's x-expires on each get: keep its path.
            yield from self._fallback.fetch(queue, count, keep_going)
            return
        channel = self._channel
        qos = channel.qos
        keys = [qos.unacked_index_key, qos.unacked_key,
                *(channel._q_for_pri(queue.name, pri) for pri in channel.priority_steps)]
        with channel.conn_or_acquire() as client:
            if self._script is None:
                self._script = client.register_script(_CLAIM_LUA)
            items = self._script(keys=keys, args=[count, repr(time())], client=client)
        for raw in items:
            message = channel.Message(json.loads(bytes_to_str(raw)), channel=channel)
            # The script wrote the Redis side; this is the channel's own record,
            # which its ack/reject/restore read.
            virtual.QoS.append(qos, message, message.delivery_tag)
            message.accept = self._accept
            yield message


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
    driver = channel.connection.client.transport.driver_type
    if driver == "redis":
        return RedisFetcher(channel, accept)
    if driver == "amqp" and hasattr(channel, "send_method"):
        return AmqpFetcher(channel, accept)
    return GetFetcher(channel, accept)
