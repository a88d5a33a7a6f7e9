"""compat.redis_claim against a real Redis: the claim writes kombu's layout, and kombu's ack and restore read it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from time import time
from typing import Any

import kombu.transport.redis
import pytest
import redis
from kombu import Connection, Exchange, Queue

from celery_durable.compat import redis_claim
from celery_durable.headers import PARKED_SUFFIX
from tests.compat.conftest import delete_redis_queues, unique
from tests.services import REDIS_URL, redis_problem, require

pytestmark = pytest.mark.redis


class RedisQueue:
    """A queue of the test's own on a kombu Redis channel whose unacked records are the test's own too."""

    def __init__(self, conn: Connection, channel: Any, queue: Queue, client: redis.Redis) -> None:
        self.conn, self.channel, self.queue, self.client = conn, channel, queue, client
        self.name = queue.name
        self.script = redis_claim.register_pass(client)

    def publish(self, body: Any, priority: int | None = None, queue: Queue | None = None) -> None:
        queue = queue or self.queue
        self.conn.Producer().publish(body, exchange=queue.exchange, routing_key=queue.routing_key,
                                     serializer="json", declare=[queue], priority=priority)

    def claim(self, count: int, now: float | None = None, queue: str | None = None) -> tuple[list[Any], ...]:
        # One ask: a claim pass over one queue, as the fetcher makes it.
        name = queue or self.name
        asks, parked = redis_claim.claim_pass(self.channel, self.client, self.script, [name], PARKED_SUFFIX,
                                              [count], count, time() if now is None else now)
        items, tags = (asks[0][2], asks[0][3]) if asks else ([], [])
        return items, tags, [item for _, item in parked]

    def message(self, item: Any) -> Any:
        return self.channel.Message(json.loads(item), channel=self.channel)

    def second_queue(self) -> Queue:
        name = f"{self.name}-b"
        queue = Queue(name, Exchange(name), routing_key=name)
        queue(self.channel).declare()
        return queue


@pytest.fixture
def redis_queue() -> Iterator[Callable[..., RedisQueue]]:
    """``redis_queue(**queue_options)``; every key it made is deleted afterwards."""
    require("Redis", redis_problem())
    made: list[tuple[Connection, str, str]] = []
    client = redis.Redis.from_url(REDIS_URL)

    def make(visibility_timeout: float = 3600, global_keyprefix: str = "", **queue_options: Any) -> RedisQueue:
        name = unique("claim")
        # Unacked records of the test's own: a restore must not touch another test's (or worker's) claims.
        options: dict[str, Any] = {
            "unacked_key": f"{name}.unacked", "unacked_index_key": f"{name}.unacked_index",
            "unacked_mutex_key": f"{name}.unacked_mutex", "visibility_timeout": visibility_timeout,
        }
        if global_keyprefix:
            options["global_keyprefix"] = global_keyprefix
        conn = Connection(REDIS_URL, transport_options=options)
        channel = conn.channel()
        queue = Queue(name, Exchange(name), routing_key=name, **queue_options)
        queue(channel).declare()
        made.append((conn, name, global_keyprefix))
        return RedisQueue(conn, channel, queue, client)

    yield make
    for conn, name, prefix in made:
        # Closing restores what the channel still holds unacked: delete after.
        conn.close()
        for at in {"", prefix}:
            delete_redis_queues(client, [name, f"{name}-b"], prefix=at)
            client.delete(*[f"{at}{name}.{key}" for key in ("unacked", "unacked_index", "unacked_mutex")])
    client.close()


def test_channel_q_for_pri_names_the_list_kombu_pushes_each_priority_to(redis_queue: Any) -> None:
    q = redis_queue()
    lists = redis_claim.priority_lists(q.channel, q.name)
    assert len(lists) == len(q.channel.priority_steps) and lists[0] == q.name
    for step, name in zip(q.channel.priority_steps, lists):
        q.publish(f"p{step}", priority=step)
        assert q.client.llen(name) == 1, f"priority {step} is not on {name!r}"


def test_channel_priority_steps_are_the_order_kombu_gets_in(redis_queue: Any) -> None:
    q = redis_queue()
    other = q.second_queue()
    mix = [("a", 9), ("b", None), ("c", 3), ("d", 0), ("e", 6), ("f", 9), ("g", 3)]
    for body, priority in mix:
        q.publish(body, priority)
        q.publish(body, priority, queue=other)

    kombu_order = []
    while (message := q.channel.basic_get(other.name, no_ack=True)) is not None:
        kombu_order.append(q.channel.message_to_python(message).decode())
    items, tags, parked = q.claim(len(mix) + 5)

    assert [q.message(item).decode() for item in items] == kombu_order
    assert kombu_order == ["b", "d", "c", "g", "e", "a", "f"]
    assert len(tags) == len(mix) and parked == []


def test_qos_unacked_key_and_index_hold_each_claim_as_kombu_restore_reads_it(redis_queue: Any) -> None:
    q = redis_queue()
    for body in ("m1", "m2", "m3"):
        q.publish(body)
    now = time()
    items, tags, _ = q.claim(2, now=now)

    assert [q.message(item).decode() for item in items] == ["m1", "m2"]
    assert q.client.llen(q.name) == 1
    for item, tag in zip(items, tags):
        message = q.message(item)
        assert tag.decode() == message.delivery_tag
        # kombu's own QoS.append writes [message._raw, exchange, routing_key].
        expected = [message._raw, message.delivery_info["exchange"], message.delivery_info["routing_key"]]
        assert json.loads(q.client.hget(q.channel.qos.unacked_key, tag)) == expected
        assert expected[1:] == [q.name, q.name]
        assert q.client.zscore(q.channel.qos.unacked_index_key, tag) == pytest.approx(now)


def test_qos_append_record_lets_message_ack_remove_both_records(redis_queue: Any) -> None:
    q = redis_queue()
    q.publish("acked")
    [item], [tag], _ = q.claim(1)
    message = q.message(item)
    redis_claim.record_unacked(q.channel, message)
    assert q.channel.qos.get(message.delivery_tag) is message

    message.ack()
    assert q.client.hget(q.channel.qos.unacked_key, tag) is None
    assert q.client.zscore(q.channel.qos.unacked_index_key, tag) is None


def test_restore_in_front_puts_claims_back_ahead_of_newer_messages_in_their_order(redis_queue: Any) -> None:
    q = redis_queue()
    for body in ("m1", "m2", "m3", "m4"):
        q.publish(body)
    items, _, _ = q.claim(3)
    messages = [q.message(item) for item in items]
    for message in messages:
        redis_claim.record_unacked(q.channel, message)
    q.publish("m5")  # sent while m1-m3 were claimed

    redis_claim.restore_in_front(messages[1:])  # m2 and m3 could not start; m1 did
    assert [m.acknowledged for m in messages] == [False, True, True]
    messages[0].ack()

    assert q.client.hlen(q.channel.qos.unacked_key) == 0 and q.client.zcard(q.channel.qos.unacked_index_key) == 0
    again, _, _ = q.claim(10)
    assert [q.message(item).decode() for item in again] == ["m2", "m3", "m4", "m5"]


def test_qos_restore_visible_puts_an_expired_claim_back_on_its_queue(redis_queue: Any) -> None:
    q = redis_queue(visibility_timeout=0)
    q.publish("lost")
    [item], [tag], _ = q.claim(1, now=time() - 1)
    redis_claim.record_unacked(q.channel, q.message(item))

    # As if the worker holding it died: kombu's restore of expired claims.
    redis_claim.restore_expired(q.channel)
    assert q.client.hget(q.channel.qos.unacked_key, tag) is None
    assert q.client.zscore(q.channel.qos.unacked_index_key, tag) is None
    [again], _, _ = q.claim(1)
    back = q.message(again)
    assert back.decode() == "lost"
    assert back.delivery_info["redelivered"] is True


@pytest.mark.skipif(not hasattr(kombu.transport.redis.Channel, "_maybe_update_queues_expire"),
                    reason="kombu < 5.7 has no queue expiry on Redis: the claim has nothing to refresh")
def test_channel_maybe_update_queues_expire_refreshes_an_expiring_queue_on_claim(redis_queue: Any) -> None:
    q = redis_queue(expires=60)
    q.publish("m1")
    q.publish("m2")
    q.client.persist(q.name)
    assert q.client.pttl(q.name) == -1
    q.claim(1)
    assert 0 < q.client.pttl(q.name) <= 60_000


@pytest.mark.parametrize("through", ["a plain client", "kombu's prefixing client"])
def test_claim_takes_what_kombu_stored_under_a_global_keyprefix_and_kombu_acks_it(redis_queue: Any,
                                                                                  through: str) -> None:
    # Before: the claim read unprefixed lists and took nothing (kombu's client
    # prefixes only the first key of an EVALSHA), so the worker fell back to one get at a time.
    prefix = "compat-prefix:"
    q = redis_queue(global_keyprefix=prefix)
    if through != "a plain client":
        with q.channel.conn_or_acquire() as client:
            q.client = client
    q.publish("m1")
    q.publish("m2")
    items, tags, _ = q.claim(1)
    assert [q.message(item).decode() for item in items] == ["m1"]
    [tag] = tags
    plain = redis.Redis.from_url(REDIS_URL)
    assert plain.hget(f"{prefix}{q.channel.qos.unacked_key}", tag) is not None
    assert plain.zscore(f"{prefix}{q.channel.qos.unacked_index_key}", tag) is not None
    assert plain.llen(f"{prefix}{q.name}") == 1  # the other message, still where kombu put it
    assert not plain.exists(q.name, q.channel.qos.unacked_key)  # nothing written unprefixed
    # kombu's own ack reads the records the claim wrote.
    redis_claim.record_unacked(q.channel, q.message(items[0]))
    q.channel.qos.ack(tag)
    assert plain.hget(f"{prefix}{q.channel.qos.unacked_key}", tag) is None


def test_claim_parks_poison_under_the_global_keyprefix(redis_queue: Any) -> None:
    prefix = "compat-prefix:"
    q = redis_queue(global_keyprefix=prefix)
    plain = redis.Redis.from_url(REDIS_URL)
    plain.lpush(f"{prefix}{q.name}", "not json")
    items, tags, parked = q.claim(1)
    assert (items, tags, parked) == ([], [], [b"not json"])
    assert plain.lrange(f"{prefix}{q.name}{PARKED_SUFFIX}", 0, -1) == [b"not json"]


# -- the idle wait's peek ------------------------------------------------------------------------------


@pytest.mark.parametrize("global_keyprefix", ["", "tenant:"])
def test_peek_answers_with_the_oldest_item_and_leaves_every_list_as_it_was(redis_queue: Any,
                                                                          global_keyprefix: str) -> None:
    q = redis_queue(global_keyprefix=global_keyprefix)
    lists = redis_claim.prefixed_priority_lists(q.channel, q.name)
    assert lists[0] == global_keyprefix + q.name
    for body in ("first", "second", "third"):
        q.publish(body)
    before = q.client.lrange(lists[0], 0, -1)
    connection = redis_claim.open_blocking_connection(q.channel)
    try:
        redis_claim.send_peek(connection, lists[0], 5)
        item = connection.read_response()
        # kombu pops the tail: the peek answers with the message a claim would take next.
        assert json.loads(item)["body"] == json.loads(before[-1])["body"]
        assert q.client.lrange(lists[0], 0, -1) == before
        # A peek that took nothing gives the claim the same message, and kombu's ack clears it.
        items, tags, _ = q.claim(1)
        assert items == [before[-1]]
    finally:
        connection.disconnect()


def test_peek_on_an_empty_list_answers_nil_at_its_timeout_and_its_socket_is_pollable(redis_queue: Any) -> None:
    q = redis_queue()
    connection = redis_claim.open_blocking_connection(q.channel)
    try:
        assert redis_claim.socket_fd(connection) >= 0
        redis_claim.send_peek(connection, redis_claim.prefixed_priority_lists(q.channel, q.name)[-1], 1)
        assert connection.read_response() is None
    finally:
        connection.disconnect()


def test_socket_fd_is_the_socket_redis_py_keeps_as_connection_sock(redis_queue: Any) -> None:
    q = redis_queue()
    connection = redis_claim.open_blocking_connection(q.channel)
    try:
        # redis-py keeps the connected socket as Connection._sock (None until connect, and after disconnect).
        assert redis_claim.socket_fd(connection) == connection._sock.fileno()
    finally:
        connection.disconnect()
    assert connection._sock is None
