"""kombu's Redis transport as the claim writes it: its priority lists, its unacked records, its queue expiry.

The claim pops and records a message in one script, in the layout kombu's own
ack, reject and restore read (``kombu/transport/redis.py``, 5.x): the unacked
index (a sorted set of delivery tags by claim time), the unacked hash
(tag → ``[payload, exchange, routing_key]``) and the channel's in-memory QoS
record. Pinned by tests/compat/test_redis_claim.py.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import virtual

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



def register(client: Any) -> Any:
    """The claim script registered on ``client`` (redis-py ``Script``)."""
    return client.register_script(_CLAIM_LUA)


def priority_lists(channel: Any, queue: str) -> list[str]:
    """The Redis lists of ``queue`` in the order kombu pops them (``Channel._q_for_pri``, ``priority_steps``)."""
    return [channel._q_for_pri(queue, pri) for pri in channel.priority_steps]


def claim(channel: Any, client: Any, script: Any, queue: str, parked_list: str, count: int,
          now: float) -> tuple[list[Any], list[Any], list[Any]]:
    """One script call: up to ``count`` items popped and recorded unacked; returns (items, tags, parked)."""
    qos = channel.qos
    keys = [qos.unacked_index_key, qos.unacked_key, parked_list, *priority_lists(channel, queue)]
    items, tags, parked = script(keys=keys, args=[count, repr(now)], client=client)
    # kombu (>= 5.7) refreshes a queue's x-expires on each get; a no-op without one.
    # Older kombu has no queue expiry on Redis, and no method for it.
    refresh_expiry = getattr(channel, "_maybe_update_queues_expire", None)
    if refresh_expiry is not None:
        refresh_expiry(client, queue)
    return list(items), list(tags), list(parked)


def record_unacked(channel: Any, message: Any) -> None:
    """The channel's own record of a claimed message, which its ack/reject/restore read.

    ``virtual.QoS.append`` (kombu 5.x): the Redis QoS overrides ``append`` to
    write the unacked hash too, which the claim script already did.
    """
    virtual.QoS.append(channel.qos, message, message.delivery_tag)


def forget_unacked(pipe: Any, channel_qos: Any, tag: Any) -> None:
    """Queue on ``pipe`` the removal of ``tag``'s unacked record (hash and index), as kombu's ack does."""
    pipe.hdel(channel_qos.unacked_key, tag)
    pipe.zrem(channel_qos.unacked_index_key, tag)


def renew_unacked(client: Any, channel_qos: Any, scores: dict[Any, float]) -> None:
    """Move the claim time of tags still unacked to ``scores`` (XX: a tag already restored is not re-added)."""
    client.zadd(channel_qos.unacked_index_key, scores, xx=True)


def restore_expired(channel: Any) -> None:
    """kombu's restore of messages whose visibility timeout passed (``QoS.restore_visible``, 5.x)."""
    # interval=1: kombu's own throttle counts calls; ours is the timer.
    channel.qos.restore_visible(num=channel.unacked_restore_limit, interval=1)
