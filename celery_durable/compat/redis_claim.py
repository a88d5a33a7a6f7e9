"""kombu's Redis transport as the claim writes it: its priority lists, its unacked records, its queue expiry.

The claim pops and records a message in one script, in the layout kombu's own
ack, reject and restore read (``kombu/transport/redis.py``, 5.x): the unacked
index (a sorted set of delivery tags by claim time), the unacked hash
(tag → ``[payload, exchange, routing_key]``) and the channel's in-memory QoS
record. Pinned by tests/compat/test_redis_claim.py.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from typing import Any

import redis
from kombu.transport import virtual


def priority_lists(channel: Any, queue: str) -> list[str]:
    """The Redis lists of ``queue`` in the order kombu pops them (``Channel._q_for_pri``, ``priority_steps``)."""
    return [channel._q_for_pri(queue, pri) for pri in channel.priority_steps]


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


def ack_many(messages: list[Any]) -> None:
    """Ack claimed Redis messages of one channel in one pipeline, as kombu's ``QoS.ack`` does one by one.

    kombu's ack is a pipeline per message (and a client checkout each); a
    claim pass that parks a batch of limited messages acks them together:
    their unacked records go in one round trip, then each message is marked
    acked as ``Message.ack`` would (``virtual.QoS.ack`` and the message state).
    """
    if not messages:
        return
    channel = messages[0].channel
    qos = channel.qos
    with channel.conn_or_acquire() as client:
        pipe = client.pipeline()
        for message in messages:
            forget_unacked(pipe, qos, message.delivery_tag)
        pipe.execute()
    for message in messages:
        virtual.QoS.ack(qos, message.delivery_tag)
        message._state = "ACK"


def restore_in_front(messages: list[Any]) -> None:
    """Put claimed Redis messages back at the head of their lists (popped next), in their order.

    kombu's ``reject(requeue=True)`` restores to the tail (``leftmost=True``),
    behind every message sent since; a message a claim pass took and could not
    start goes back where it was, ahead of the ones sent after it. Its restore
    is kombu's own (``QoS.restore_by_tag``: the unacked record and the push in
    one transaction); then each message is marked rejected as
    ``Message.reject`` would (``virtual.QoS.ack`` and the message state).
    """
    for message in reversed(messages):  # each push goes ahead of the one before: the first ends up first
        qos = message.channel.qos
        qos.restore_by_tag(message.delivery_tag, leftmost=False)
        virtual.QoS.ack(qos, message.delivery_tag)
        message._state = "REJECTED"


def renew_unacked(client: Any, channel_qos: Any, scores: dict[Any, float]) -> None:
    """Move the claim time of tags still unacked to ``scores`` (XX: a tag already restored is not re-added)."""
    client.zadd(channel_qos.unacked_index_key, scores, xx=True)


def restore_expired(channel: Any) -> None:
    """kombu's restore of messages whose visibility timeout passed (``QoS.restore_visible``, 5.x)."""
    # interval=1: kombu's own throttle counts calls; ours is the timer.
    channel.qos.restore_visible(num=channel.unacked_restore_limit, interval=1)


# A whole claim pass in one script call: the sweep of planning/claim_sweep.py
# (next_ask/record), walked server-side over the queues in the pass's rotated
# order. Each ask pops from the queue's priority lists in kombu's order and
# records each message in the unacked index and hash in the format kombu's
# restore reads ([payload, exchange, routing_key]). kombu's own get does the pop
# and the unacked write in two round trips and not atomically (a crash between
# them loses the message); this does both at once. An item that is not a kombu
# message (not JSON, or no properties, string delivery_tag or delivery_info) is
# pushed to the queue's parked list and the pop goes on: one poison item must
# neither fail the script (the worker would exit, and good items popped before
# it would sit unacked) nor cost the ask. A single ask is a pass over one queue.
# The Python planner replays the asks this returns and refuses a pass that
# differs from its own plan, so the rules live in one place and this is only
# their executor.
# The script names each queue's lists itself, as kombu's Channel._q_for_pri
# does (step 0: the queue's own name; step p: name .. sep .. p), so a pass over
# many queues sends their names once, not four keys each.
# KEYS: unacked index, unacked hash (each with the transport's global_keyprefix),
# and optionally the claiming worker's held set (compat/redis_holders.py): each
# tag recorded unacked goes there in the same script, so no claimed message is
# ever unacked without a holder a live worker can find dead.
# ARGV: now, room (-1: no process cap), sep, parked suffix, then as JSON arrays
# the priority steps, the queue names and their free slots (three strings: a
# pass over hundreds of queues encodes in microseconds, not one argument each),
# then the global_keyprefix the script puts before every list it names, then
# as a JSON array the tags of finished runs whose ack rides with this pass
# (compat/redis_acks.py): removed from the unacked index, hash and held set
# before any pop, as kombu's QoS.ack writes it, so the ack and the claim its
# freed slot makes cost one round trip.
# Returns {asks, parked}: each ask that took items {queue number, count, items,
# tags} (an ask that took none changes nothing the planner tracks but its place,
# so it is left out: a pass over 200 mostly empty queues answers in a few bytes),
# each parked item {queue number, item}. Empty queues are passed over by a bulk
# EXISTS per stretch of queues and one per queue, not a pop per priority list.
_PASS_LUA = """
local now = ARGV[1]
local room = tonumber(ARGV[2])
local sep = ARGV[3]
local parked_suffix = ARGV[4]
local steps = cjson.decode(ARGV[5])
local nsteps = #steps
local names = cjson.decode(ARGV[6])
local free = cjson.decode(ARGV[7])
local prefix = ARGV[8]
local acks = cjson.decode(ARGV[9])
for i = 1, #acks do
  redis.call('ZREM', KEYS[1], acks[i])
  redis.call('HDEL', KEYS[2], acks[i])
  if KEYS[3] then redis.call('ZREM', KEYS[3], acks[i]) end
end
local order = {}
for q = 1, #names do order[q] = q end
local function list_for(q, step)
  if step == 0 then return prefix .. names[q] end
  return prefix .. names[q] .. sep .. step
end
local again = {}
local asks = {}
local parked = {}
-- Orders the held set within one pass (every tag of a pass shares its claim time).
local held_seq = 0
-- cjson refuses a \\u escape of a lone UTF-16 surrogate, which Python's json
-- (kombu's) writes and reads back: Celery's argsrepr header keeps such a
-- character from a task's arguments. Only the properties are read here, so an
-- item cjson refuses is read once more with every surrogate escape made '?';
-- the item itself is stored and returned as it came.
local surrogate_escape = string.char(92) .. 'u[dD][89a-fA-F]%x%x'
local placeholder_escape = string.char(92) .. 'u003f'
local function decode(item)
  local ok, msg = pcall(cjson.decode, item)
  if ok then return ok, msg end
  local lenient = string.gsub(item, surrogate_escape, placeholder_escape)
  return pcall(cjson.decode, lenient)
end
local function pop(q, want)
  local items, tags = {}, {}
  local lists = {}
  for s = 1, nsteps do lists[s] = list_for(q, steps[s]) end
  if redis.call('EXISTS', unpack(lists)) == 0 then return items, tags end
  for s = 1, nsteps do
    local list = lists[s]
    while #items < want do
      local item = redis.call('RPOP', list)
      if not item then break end
      local ok, msg = decode(item)
      local props = ok and type(msg) == 'table' and msg['properties']
      local info = type(props) == 'table' and props['delivery_info']
      local tag = type(props) == 'table' and props['delivery_tag']
      if type(info) == 'table' and type(tag) == 'string' then
        redis.call('ZADD', KEYS[1], now, tag)
        if KEYS[3] then
          held_seq = held_seq + 1
          redis.call('ZADD', KEYS[3], tonumber(now) + held_seq / 1000000, tag)
        end
        redis.call('HSET', KEYS[2], tag,
          '[' .. item .. ',' .. cjson.encode(info['exchange']) .. ',' .. cjson.encode(info['routing_key']) .. ']')
        items[#items + 1] = item
        tags[#tags + 1] = tag
      else
        redis.call('LPUSH', prefix .. names[q] .. parked_suffix, item)
        parked[#parked + 1] = {q, item}
      end
    end
    if #items >= want then break end
  end
  return items, tags
end
-- A bulk EXISTS over the lists of the next 32 queues of the round passes over
-- a stretch of empty queues in one call (a queue per call costs ~1 us each):
-- lists_may_exist[q] is false when that call found none of the stretch's lists.
local lists_may_exist = {}
local function check_stretch(order, from)
  local keys, members = {}, {}
  for i = from, math.min(from + 31, #order) do
    local q = order[i]
    if lists_may_exist[q] == nil then
      members[#members + 1] = q
      for s = 1, nsteps do keys[#keys + 1] = list_for(q, steps[s]) end
    end
  end
  local some = redis.call('EXISTS', unpack(keys)) > 0
  for _, q in ipairs(members) do lists_may_exist[q] = some end
end
local pos = 1
while true do
  if room == 0 then break end
  if pos > #order then
    if #again == 0 then break end
    order, pos, again = again, 1, {}
  end
  local q = order[pos]
  local after = #order - pos
  pos = pos + 1
  local slots = free[q]
  if slots > 0 then
    if lists_may_exist[q] == nil then check_stretch(order, pos - 1) end
    local count, share_bound = slots, false
    if room > 0 then
      local share = math.ceil(room / (after + 1))
      if share < slots then count, share_bound = share, true end
    end
    -- A queue with no list is an ask that took nothing.
    local items, tags = {}, {}
    if lists_may_exist[q] then items, tags = pop(q, count) end
    local got = #items
    if got > 0 then
      asks[#asks + 1] = {q, count, items, tags}
      free[q] = free[q] - got
      if room > 0 then room = room - got end
      if share_bound and got == count and free[q] > 0 then again[#again + 1] = q end
    end
  end
end
return {asks, parked}
"""


def register_pass(client: Any) -> Any:
    """The whole-pass claim script registered on ``client`` (redis-py ``Script``)."""
    return client.register_script(_PASS_LUA)


_plain_clients: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def unprefixed(client: Any) -> Any:
    """A client that sends keys as given, on ``client``'s connection pool.

    With the transport option ``global_keyprefix`` kombu's client is a
    ``PrefixedStrictRedis``, which prefixes only the first key of an EVALSHA
    (kombu 5.x ``PREFIXED_COMPLEX_COMMANDS``): the claim script gets every key
    and list name already prefixed instead, and runs on a plain client.
    """
    if not getattr(client, "global_keyprefix", ""):
        return client
    plain = _plain_clients.get(client)
    if plain is None:
        plain = _plain_clients[client] = redis.Redis(connection_pool=client.connection_pool)
    return plain


ClaimedAsk = tuple[str, int, list[Any], list[Any]]


def claim_pass(channel: Any, client: Any, script: Any, queues: list[str], parked_suffix: str,
               free: list[int], room: int | None, now: float,
               held_key: str | None = None,
               acks: Sequence[Any] = ()) -> tuple[list[ClaimedAsk], list[tuple[str, Any]]]:
    """One script call for a whole pass over ``queues`` (in the pass's order), first acking ``acks``.

    Returns the asks that took items, each ``(queue, count, items, tags)``, and the
    items it parked (on ``queue + parked_suffix``), each ``(queue, item)``.
    The script names the priority lists as ``Channel._q_for_pri`` does, from the
    channel's ``sep`` and ``priority_steps`` (kombu 5.x), each behind the
    channel's ``global_keyprefix``, as kombu's own client writes them.
    """
    qos = channel.qos
    prefix = key_prefix(channel)
    keys: list[str] = [prefix + qos.unacked_index_key, prefix + qos.unacked_key]
    if held_key is not None:
        keys.append(held_key)
    steps = [channel.priority(step) for step in channel.priority_steps]
    args = [repr(now), -1 if room is None else room, channel.sep, parked_suffix,
            json.dumps(steps), json.dumps(queues), json.dumps(free), prefix, json.dumps(list(acks))]
    asks, parked_items = script(keys=keys, args=args, client=unprefixed(client))
    refresh_expiry = getattr(channel, "_maybe_update_queues_expire", None)
    taken = []
    for number, count, items, tags in asks:
        queue = queues[int(number) - 1]
        if refresh_expiry is not None:
            refresh_expiry(client, queue)
        taken.append((queue, int(count), list(items), list(tags)))
    return taken, [(queues[int(number) - 1], item) for number, item in parked_items]


# -- the idle wait's peek: a blocking read that takes nothing --------------------------------------


def key_prefix(channel: Any) -> str:
    """The transport option ``global_keyprefix`` kombu's client puts before every key ("" without one)."""
    return getattr(channel, "global_keyprefix", "") or ""


def prefixed_priority_lists(channel: Any, queue: str) -> list[str]:
    """``queue``'s Redis lists as the server names them: kombu's priority lists behind ``global_keyprefix``."""
    prefix = key_prefix(channel)
    return [prefix + name for name in priority_lists(channel, queue)]


def open_blocking_connection(channel: Any) -> Any:
    """A connection of its own, made like the channel client's (host, db, auth, protocol, TLS).

    Made outside the pool (``ConnectionPool.make_connection``, redis-py 5.x): a
    blocking command holds it until the server answers, and the hub polls its socket.
    """
    connection = channel.client.connection_pool.make_connection()
    connection.connect()
    return connection


def socket_fd(connection: Any) -> int:
    """The file descriptor the hub polls for ``connection``'s reply (redis-py's ``Connection._sock``)."""
    return int(connection._sock.fileno())


def send_peek(connection: Any, key: str, timeout: float) -> None:
    """Block until ``key`` has an item, taking none: BLMOVE from the tail back onto the tail.

    The tail is where kombu pops (it LPUSHes and BRPOPs), so the list is
    unchanged, in order. The reply is the item, or nil after ``timeout`` seconds.
    Redis >= 6.2 (BLMOVE); an older server answers with an error.
    """
    connection.send_command("BLMOVE", key, key, "RIGHT", "RIGHT", timeout)
