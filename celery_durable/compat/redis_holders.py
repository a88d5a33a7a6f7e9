"""Which live worker holds which of kombu's Redis unacked records: heartbeats, held sets, and their restore.

kombu keeps a claimed message in its unacked hash (tag → ``[payload,
exchange, routing_key]``) and index (tag → claim time), and puts it back once
``visibility_timeout`` (1 h by default) has passed, whoever held it. Beside
those records each ``-P durable`` worker keeps:

- ``unacked.durable_holders``: a sorted set of holder tokens by when each
  one's heartbeat runs out (its last beat plus its own lease TTL: workers with
  different TTLs share one set), in Redis's own clock (``TIME`` inside a
  script), so no worker's clock decides who is alive;
- ``unacked.durable_held.<holder>``: the tags that holder claimed, in claim
  order (a sorted set: the claim script adds each as it records it unacked, in
  the same script).

(``unacked`` is kombu's unacked hash name, so apps configured with hashes of
their own never judge each other's holders.)

A holder whose heartbeat ran out is dead: any live worker
puts its records back at the head of their queues (kombu's ``restore_by_tag``).
Every live worker scans, so a tag goes back only by the restorer that first
takes it: out of the dead holder's set (``ZREM`` answers 1 to one caller), or,
past ``visibility_timeout``, by moving its claim time to now. Without that a
second restorer, on a list read a moment before, found the tag unacked again
(restored, then claimed by a live worker) and put a second copy in the queue.
A tag in a live holder's set is never restored, whatever ``visibility_timeout``
says; a record in no held set (a stock worker's) keeps kombu's rule. Every key
is behind the transport's ``global_keyprefix``. Pinned by tests/compat/test_redis_holders.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from celery_durable.compat.redis_claim import key_prefix, unprefixed
from celery_durable.headers import HELD_SUFFIX, HOLDERS_SUFFIX

# Suffixes of kombu's unacked hash name (``unacked`` unless the transport options say otherwise): holders
# are kept per unacked hash, since a holder's tags mean something only in the hash they were recorded in.

# Redis < 5 replicates a script by its text, and a script that read TIME
# would replay differently: ask for its effects to be replicated instead
# (a no-op on Redis >= 5, where that is the only mode).
_NOW_LUA = """
if redis.replicate_commands then pcall(redis.replicate_commands) end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# KEYS: holders, this holder's held set, the unacked hash. ARGV: holder, its TTL.
# The heartbeat, and the pruning of tags acked since the last one (kombu's
# ack removes the unacked record, not our held-set entry).
_BEAT_LUA = _NOW_LUA + """
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
for _, tag in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if redis.call('HEXISTS', KEYS[3], tag) == 0 then redis.call('ZREM', KEYS[2], tag) end
end
return tostring(now)
"""

# KEYS: holders. The holders whose heartbeat ran out.
_DEAD_LUA = _NOW_LUA + """
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. tostring(now))
"""

# KEYS: holders, the dead holder's held set. ARGV: holder. Forget a holder
# whose records were restored, unless it beat again meanwhile (a stopped
# process resumed): then it keeps its entry and its set.
_FORGET_LUA = _NOW_LUA + """
local runs_out = redis.call('ZSCORE', KEYS[1], ARGV[1])
if runs_out and tonumber(runs_out) >= now then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
return 1
"""

# KEYS: unacked index, holders. ARGV: ceiling (claim time before which a record
# is past visibility_timeout, in the claimers' clock, as kombu compares it),
# how many at most, the held-set key prefix. The expired tags no live holder
# holds, newest first (kombu's restore order: each goes to the head, so the
# oldest ends up first).
_EXPIRED_LUA = _NOW_LUA + """
local live = redis.call('ZRANGEBYSCORE', KEYS[2], tostring(now), '+inf')
local expired = redis.call('ZREVRANGEBYSCORE', KEYS[1], ARGV[1], '-inf', 'LIMIT', 0, tonumber(ARGV[2]))
local free = {}
for _, tag in ipairs(expired) do
  local held = false
  for _, holder in ipairs(live) do
    if redis.call('ZSCORE', ARGV[3] .. holder, tag) then held = true break end
  end
  if not held then free[#free + 1] = tag end
end
return free
"""


# KEYS: unacked index. ARGV: ceiling (as _EXPIRED_LUA's), now (the caller's clock, which claim times
# are in, as kombu writes them), then tags. Of the tags, those still claimed before the ceiling, each
# given a claim time of now: the caller restores them; any other restorer finds them fresh and leaves
# them. A restorer that dies before its restore leaves a record a visibility timeout younger, restored
# then: never lost.
_TAKE_EXPIRED_LUA = """
local taken = {}
for i = 3, #ARGV do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score and tonumber(score) <= tonumber(ARGV[1]) then
    redis.call('ZADD', KEYS[1], ARGV[2], ARGV[i])
    taken[#taken + 1] = ARGV[i]
  end
end
return taken
"""


class HeldSetUnreadable(Exception):
    """A dead holder's held-set key holds something other than a held set."""


class HolderKeys:
    """The liveness keys of one channel's Redis, behind its ``global_keyprefix``."""

    def __init__(self, channel: Any) -> None:
        prefix = key_prefix(channel)
        self.unacked: str = prefix + str(channel.qos.unacked_key)
        self.unacked_index: str = prefix + str(channel.qos.unacked_index_key)
        self.holders = self.unacked + HOLDERS_SUFFIX
        self.held_prefix = self.unacked + HELD_SUFFIX

    def held(self, holder: str) -> str:
        return self.held_prefix + holder


class HolderScripts:
    """The liveness scripts, registered once on a channel's client (run with every key already prefixed)."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.keys = HolderKeys(channel)
        with channel.conn_or_acquire() as client:
            self.client = unprefixed(client)
        self._beat = self.client.register_script(_BEAT_LUA)
        self._dead = self.client.register_script(_DEAD_LUA)
        self._forget = self.client.register_script(_FORGET_LUA)
        self._expired = self.client.register_script(_EXPIRED_LUA)
        self._take_expired = self.client.register_script(_TAKE_EXPIRED_LUA)

    def beat(self, holder: str, ttl: float) -> float:
        """Record ``holder`` alive for ``ttl`` from now (Redis's clock), pruning its held set of acked tags.

        Returns Redis's now."""
        keys = self.keys
        return float(self._beat(keys=[keys.holders, keys.held(holder), keys.unacked], args=[holder, repr(ttl)]))

    def leave(self, holder: str) -> None:
        """Mark ``holder`` dead at once (a clean stop): whatever it still holds is restored by the next scan."""
        self.client.zadd(self.keys.holders, {holder: 0})

    def dead(self) -> list[str]:
        """The holders whose heartbeat ran out (each by its own TTL)."""
        return [_text(h) for h in self._dead(keys=[self.keys.holders], args=[])]

    def held_tags_oldest_last(self, holder: str) -> list[str]:
        """The tags ``holder`` held that are still unacked, newest claim first (the order to restore them in).

        Raises HeldSetUnreadable when the key is not a held set (written by something else).
        """
        try:
            tags = [_text(t) for t in self.client.zrange(self.keys.held(holder), 0, -1, desc=True)]
        except redis.exceptions.ResponseError as exc:
            raise HeldSetUnreadable(f"{self.keys.held(holder)}: {exc}") from exc
        if not tags:
            return []
        with self.client.pipeline(transaction=False) as pipe:
            for tag in tags:
                pipe.hexists(self.keys.unacked, tag)
            still = pipe.execute()
        return [tag for tag, unacked in zip(tags, still) if unacked]

    def discard(self, holder: str) -> None:
        """Drop ``holder`` and its held set whatever they hold (its records then follow kombu's rule)."""
        with self.client.pipeline() as pipe:
            pipe.zrem(self.keys.holders, holder)
            pipe.delete(self.keys.held(holder))
            pipe.execute()

    def forget(self, holder: str) -> bool:
        return bool(self._forget(keys=[self.keys.holders, self.keys.held(holder)], args=[holder]))

    def expired_unheld(self, ceiling: float, limit: int) -> list[str]:
        keys = self.keys
        found = self._expired(keys=[keys.unacked_index, keys.holders],
                              args=[repr(ceiling), limit, keys.held_prefix])
        return [_text(t) for t in found]

    def take_held(self, holder: str, tags: Sequence[str]) -> list[str]:
        """Of ``tags``, those this caller took out of ``holder``'s held set: its to restore, no other's.

        A restorer that dies before its restore leaves the record unacked in no held set: kombu's
        visibility timeout brings it back (``expired_unheld``), late but never lost.
        """
        if not tags:
            return []
        with self.client.pipeline(transaction=False) as pipe:
            for tag in tags:
                pipe.zrem(self.keys.held(holder), tag)
            removed = pipe.execute()
        return [tag for tag, count in zip(tags, removed) if count]

    def take_expired(self, tags: Sequence[str], ceiling: float, now: float) -> list[str]:
        """Of ``tags``, those still claimed before ``ceiling``, now this caller's to restore (their claim
        time moved to ``now``, so a restorer that read the same list leaves them)."""
        if not tags:
            return []
        keys = self.keys
        found = self._take_expired(keys=[keys.unacked_index], args=[repr(ceiling), repr(now), *tags])
        return [_text(t) for t in found]

    def restore(self, tags: Sequence[str]) -> None:
        """Put each tag's record back at the head of its queue, in order (kombu's ``QoS.restore_by_tag``).

        Only tags this caller took (``take_held``, ``take_expired``): another restorer's tag may be a
        live worker's claim again by now.
        """
        qos = self.channel.qos
        for tag in tags:
            qos.restore_by_tag(tag, leftmost=False)


def held_key(channel: Any, holder: str) -> str:
    """The held-set key the claim script adds ``holder``'s tags to."""
    return HolderKeys(channel).held(holder)


def restore_limit(channel: Any) -> int:
    """How many expired records kombu restores per scan (``unacked_restore_limit``; -1: no limit, as None is)."""
    limit = channel.unacked_restore_limit
    return -1 if limit is None else int(limit)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
