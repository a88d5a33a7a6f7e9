"""Redis visibility: restore expired unacked messages, and keep this worker's own held messages from expiring."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from time import time
from typing import Any

from celery_durable.compat.redis_claim import renew_unacked, restore_expired

logger = logging.getLogger(__name__)

#: Renewals per visibility timeout: a worker whose loop stalls for a while
#: (a long GC, a slow drain) still renews well before any message expires.
RENEWALS_PER_TIMEOUT = 4


class RedisRestorer:
    """Puts messages whose visibility timeout passed back on their queue, and renews the ones held here.

    kombu restores them only for channels with active push consumers
    (``MultiChannelPoller.maybe_restore_messages``); a claiming worker has
    none, so without this a message held by a killed worker would stay
    unacked forever. And a restore cannot tell a dead worker's message from a
    live one's: a run longer than ``visibility_timeout`` (or an ETA, a durable
    sleep, waiting in this worker) would be delivered a second time. So every
    message this worker holds has its claim time pushed forward well inside
    the timeout, the way Sidekiq's reliable fetch keeps its heartbeat: only a
    worker that stopped renewing has its messages restored.
    """

    def __init__(self, channel: Any, interval: float) -> None:
        self._channel = channel
        self.interval = interval

    @classmethod
    def for_connection(cls, connection: Any, interval: float) -> RedisRestorer | None:
        if connection.transport.driver_type != "redis":
            return None
        return cls(connection.channel(), interval)

    @property
    def renew_interval(self) -> float:
        return max(float(self._channel.visibility_timeout) / RENEWALS_PER_TIMEOUT, 0.05)

    def restore(self) -> None:
        try:
            restore_expired(self._channel)
        except self._channel.connection_errors:
            logger.warning("durable.redis.restore_failed", exc_info=True)

    def renew(self, messages: Iterable[Any]) -> int:
        """Mark every still-unacked message of ``messages`` as claimed now; returns how many were renewed."""
        scores = {message.delivery_tag: time() for message in messages
                  if not message.acknowledged and message.delivery_tag is not None}
        if not scores:
            return 0
        try:
            with self._channel.conn_or_acquire() as client:
                # XX: only tags still in the index. A tag another worker already
                # restored (this one's renewals were late) is not re-added as held.
                renew_unacked(client, self._channel.qos, scores)
        except self._channel.connection_errors:
            logger.warning("durable.redis.renew_failed held=%d", len(scores), exc_info=True)
            return 0
        return len(scores)
