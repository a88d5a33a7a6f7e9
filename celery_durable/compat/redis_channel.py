"""kombu's Redis ``Channel`` beyond its documented API: its pooled client, its QoS and its visibility timeout.

kombu documents the Redis transport's options (``visibility_timeout``,
``global_keyprefix``) but not the channel attributes that carry them, nor
``Channel.conn_or_acquire`` (a client on the channel's connection pool,
kombu 5.x ``transport/redis.py``) or ``Channel.qos`` (the virtual channel's
QoS, whose unacked hash and index the worker renews and prunes). Pinned by
tests/compat/test_redis_channel.py; checked at boot by compat.host_check.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, TypeGuard

from celery_durable.compat.host_types import HostChannel, RedisChannel


def is_redis(channel: HostChannel) -> TypeGuard[RedisChannel]:
    """True for a channel of kombu's Redis transport."""
    return bool(channel.connection.client.transport.driver_type == "redis")


def channel_client(channel: RedisChannel) -> AbstractContextManager[Any]:
    """A redis-py client on ``channel``'s own connection pool (key prefix included): ``with channel_client(c) as r``."""
    client: AbstractContextManager[Any] = channel.conn_or_acquire()
    return client


def channel_qos(channel: RedisChannel) -> Any:
    """The channel's QoS: kombu's record of what it delivered unacked (``unacked_key``, ``unacked_index_key``)."""
    return channel.qos


def visibility_timeout(channel: RedisChannel) -> float:
    """The transport option ``visibility_timeout`` the channel's QoS compares claim times with."""
    return float(channel.visibility_timeout)
