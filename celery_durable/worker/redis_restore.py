"""Redis held messages: this worker's heartbeat and held set, and the restore of what no live worker holds."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from time import time
from typing import Any

from celery_durable.clock import SYSTEM_CLOCK, Clock
from celery_durable.compat.host_types import RedisChannel
from celery_durable.compat.redis_channel import channel_client, channel_qos, visibility_timeout
from celery_durable.compat.redis_claim import renew_unacked
from celery_durable.compat.redis_holders import (
    HeldSetUnreadable,
    HolderScripts,
    held_key,
    restore_limit,
)

logger = logging.getLogger(__name__)

#: Renewals per visibility timeout: a worker whose loop stalls for a while
#: (a long GC, a slow drain) still renews well before any message expires.
RENEWALS_PER_TIMEOUT = 4
#: Heartbeats per lease TTL, and scans for dead holders: a killed worker's
#: messages are back on their queues within TTL + TTL / BEATS_PER_TTL.
BEATS_PER_TTL = 3


class RedisRestorer:
    """Keeps this worker's claims known to be alive, and puts back the claims of workers that are not.

    kombu restores unacked messages only once ``visibility_timeout`` passed
    (an hour by default), and cannot tell a dead worker's message from a live
    one's. Here liveness decides (compat/redis_holders.py): every message this
    worker claims is in its held set, its heartbeat renews it every third of
    ``durable_lease_ttl``, and once a holder's heartbeat is a TTL old any live
    worker puts that holder's messages back at the head of their queues, as
    Sidekiq's super_fetch does for a dead process. A live holder's messages are
    never restored, however long they run or wait (an ETA, a durable sleep).
    Messages in no held set (a stock worker's, in a mixed fleet) keep kombu's
    rule, whose claim times this worker also renews for its own so a stock
    worker never restores them either.
    """

    def __init__(self, channel: RedisChannel, interval: float, holder: str, lease_ttl: float,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self._channel = channel
        self.interval = interval
        self.holder = holder
        self.lease_ttl = lease_ttl
        self._scripts: HolderScripts | None = None
        self._clock = clock
        #: Since when this worker's beats have reached Redis without a break (None: the last one failed).
        self._beating_since: float | None = None

    @classmethod
    def for_connection(cls, connection: Any, interval: float, holder: str, lease_ttl: float) -> RedisRestorer | None:
        if connection.transport.driver_type != "redis":
            return None
        return cls(connection.channel(), interval, holder, lease_ttl)

    @property
    def held_key(self) -> str:
        """The held set the claim script records this worker's claims in."""
        return held_key(self._channel, self.holder)

    @property
    def renew_interval(self) -> float:
        return max(visibility_timeout(self._channel) / RENEWALS_PER_TIMEOUT, 0.05)

    @property
    def beat_interval(self) -> float:
        return self.lease_ttl / BEATS_PER_TTL

    def _holder_scripts(self) -> HolderScripts:
        if self._scripts is None:
            self._scripts = HolderScripts(self._channel)
        return self._scripts

    def beat(self) -> None:
        """Say this worker is alive, then put back what dead holders held."""
        try:
            scripts = self._holder_scripts()
            scripts.beat(self.holder, self.lease_ttl)
            if self._beating_since is None:
                self._beating_since = self._clock.monotonic()
            if not self._may_judge():
                return
            for dead in scripts.dead():
                self._restore_holder(scripts, dead)
        except self._channel.connection_errors as exc:
            self._beating_since = None
            logger.warning("durable.redis.heartbeat_failed error=%s", exc,
                           extra={"event": "durable.redis.heartbeat_failed", "error": repr(exc)})

    def _may_judge(self) -> bool:
        """Whether this worker has beaten for a whole TTL without a break.

        After Redis was away (or this worker was cut off from it) every holder's
        last beat is old, the live ones' too: they are judged only once each has
        had a TTL to beat again. A worker just started waits the same TTL.
        """
        return self._beating_since is not None and self._clock.monotonic() - self._beating_since >= self.lease_ttl

    def _restore_holder(self, scripts: HolderScripts, dead: str) -> None:
        try:
            tags = scripts.held_tags_oldest_last(dead)
        except HeldSetUnreadable as exc:
            # Not ours to read: dropped once, so it costs one line, not one per beat. Whatever it
            # held unacked comes back by kombu's visibility timeout.
            scripts.discard(dead)
            logger.warning("durable.redis.holder_unreadable holder=%s error=%s: dropped; its unacked messages "
                           "come back after visibility_timeout", dead, exc,
                           extra={"event": "durable.redis.holder_unreadable", "holder": dead, "error": repr(exc)})
            return
        # Every live worker scans: only the tags this one takes out of the dead holder's set are its
        # to restore (another may have restored one already, and a live worker claimed it again).
        taken = scripts.take_held(dead, tags)
        scripts.restore(taken)
        if scripts.forget(dead) and taken:
            logger.warning("durable.redis.restored_dead_holder holder=%s messages=%d: its heartbeat stopped; "
                           "what it held is back at the head of its queues", dead, len(taken),
                           extra={"event": "durable.redis.restored_dead_holder", "holder": dead,
                                  "messages": len(taken)})

    def restore(self) -> None:
        """kombu's restore of claims past ``visibility_timeout``, but never one a live holder holds."""
        if not self._may_judge():
            return  # which holders are live is not known yet: restore nothing a live one may hold
        try:
            scripts = self._holder_scripts()
            now = time()
            ceiling = now - visibility_timeout(self._channel)
            expired = scripts.expired_unheld(ceiling, restore_limit(self._channel))
            scripts.restore(scripts.take_expired(expired, ceiling, now))
        except self._channel.connection_errors:
            logger.warning("durable.redis.restore_failed", exc_info=True,
                           extra={"event": "durable.redis.restore_failed"})

    def leave(self) -> None:
        """A clean stop: mark this worker dead now, so anything it still holds comes back at the next scan."""
        try:
            self._holder_scripts().leave(self.holder)
        except self._channel.connection_errors as exc:
            logger.warning("durable.redis.leave_failed error=%s: what this worker still holds comes back one "
                           "lease TTL from its last heartbeat", exc,
                           extra={"event": "durable.redis.leave_failed", "error": repr(exc)})

    def renew(self, messages: Iterable[Any]) -> int:
        """Mark every still-unacked message of ``messages`` as claimed now; returns how many were renewed."""
        scores = {message.delivery_tag: time() for message in messages
                  if not message.acknowledged and message.delivery_tag is not None}
        if not scores:
            return 0
        try:
            with channel_client(self._channel) as client:
                # XX: only tags still in the index. A tag another worker already
                # restored (this one's renewals were late) is not re-added as held.
                renew_unacked(client, channel_qos(self._channel), scores)
        except self._channel.connection_errors:
            logger.warning("durable.redis.renew_failed held=%d", len(scores), exc_info=True,
                           extra={"event": "durable.redis.renew_failed", "held": len(scores)})
            return 0
        return len(scores)
