"""Restores expired unacked Redis messages, which a worker that never consumes push-style must do itself."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class RedisRestorer:
    """Puts messages whose visibility timeout passed back on their queue.

    kombu restores them only for channels with active push consumers
    (``MultiChannelPoller.maybe_restore_messages``); a claiming worker has
    none, so without this a message held by a killed worker would stay
    unacked forever.
    """

    def __init__(self, channel: Any, interval: float) -> None:
        self._channel = channel
        self.interval = interval

    @classmethod
    def for_connection(cls, connection: Any, interval: float) -> RedisRestorer | None:
        if connection.transport.driver_type != "redis":
            return None
        return cls(connection.channel(), interval)

    def restore(self) -> None:
        try:
            # interval=1: kombu's own throttle counts calls; ours is the timer.
            self._channel.qos.restore_visible(num=self._channel.unacked_restore_limit, interval=1)
        except self._channel.connection_errors:
            logger.warning("durable.redis.restore_failed", exc_info=True)
