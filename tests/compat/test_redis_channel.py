"""compat.redis_channel against a real Redis: the channel's client, QoS and visibility timeout are kombu's own."""

from __future__ import annotations

from typing import Any

import pytest

from celery_durable.compat import redis_channel
from tests.compat.test_redis_claim import RedisQueue, redis_queue  # noqa: F401 - redis_queue is a fixture

pytestmark = pytest.mark.redis


def test_channel_client_is_on_the_channels_pool_and_reaches_its_queue(redis_queue: Any) -> None:
    q: RedisQueue = redis_queue()
    q.publish({"n": 1})
    with redis_channel.channel_client(q.channel) as client:
        assert client.connection_pool is q.channel.pool
        assert client.llen(q.name) == 1


def test_channel_client_carries_the_global_keyprefix(redis_queue: Any) -> None:
    q: RedisQueue = redis_queue(global_keyprefix="compat-prefix:")
    q.publish({"n": 1})
    with redis_channel.channel_client(q.channel) as client:
        # The prefixing client adds the prefix itself: the bare name reaches the prefixed key.
        assert client.llen(q.name) == 1
    assert q.client.llen(f"compat-prefix:{q.name}") == 1


def test_channel_qos_records_a_delivered_message_unacked_until_it_is_acked(redis_queue: Any) -> None:
    q: RedisQueue = redis_queue()
    q.publish({"n": 1})
    message = q.channel.basic_get(q.name, no_ack=False)
    qos = redis_channel.channel_qos(q.channel)
    assert qos is q.channel.qos
    assert q.client.hexists(qos.unacked_key, message.delivery_tag)
    message.ack()
    assert not q.client.hexists(qos.unacked_key, message.delivery_tag)


@pytest.mark.parametrize("seconds", [3600, 7.5])
def test_visibility_timeout_is_the_transport_option(redis_queue: Any, seconds: float) -> None:
    q: RedisQueue = redis_queue(visibility_timeout=seconds)
    assert redis_channel.visibility_timeout(q.channel) == seconds
    # What kombu's restore compares claim times with.
    assert q.channel.qos.visibility_timeout == seconds
