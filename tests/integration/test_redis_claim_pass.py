"""A whole claim pass in one Redis script call: the same asks, in the same order, as the pure planner."""

from __future__ import annotations

import json
import random
import uuid

import pytest
import redis
from kombu import Connection, Exchange, Queue

from celery_durable.planning.claim_sweep import Sweep, begin_sweep, next_ask, record
from celery_durable.worker.fetchers import RedisFetcher
from tests.services import REDIS_URL, redis_problem, require


@pytest.fixture
def redis_queues():
    require("Redis", redis_problem())
    made: list[str] = []
    # Unacked records of the test's own, apart from db 0's shared index (other tests restore from it).
    tag = f"pass-{uuid.uuid4().hex[:8]}"
    own = {"unacked_key": f"{tag}.unacked", "unacked_index_key": f"{tag}.unacked_index",
           "unacked_mutex_key": f"{tag}.unacked_mutex"}
    with Connection(REDIS_URL, transport_options=own) as conn:
        channel = conn.channel()

        def make(count: int) -> list[Queue]:
            queues = []
            for _ in range(count):
                name = f"pass-{uuid.uuid4().hex[:8]}"
                queue = Queue(name, Exchange(name), routing_key=name)
                queue(channel).declare()
                made.append(name)
                queues.append(queue)
            return queues

        yield conn, channel, make
    # After the close: closing restores what the channel still holds unacked onto the queues.
    client = redis.Redis.from_url(REDIS_URL)
    for name in made:
        client.delete(name, f"{name}.durable.parked", *[f"{name}\x06\x16{p}" for p in (3, 6, 9)],
                      f"_kombu.binding.{name}", f"_kombu.binding_permanent.{name}")
    client.delete(*own.values())


def publish(conn, queue, *bodies, priority=None, headers=None):
    producer = conn.Producer()
    for body in bodies:
        producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key,
                         serializer="json", declare=[queue], priority=priority, headers=headers)


def planned(sweep: Sweep, waiting: dict[str, int]) -> list[tuple[str, int, int]]:
    """The asks the sequential planner makes against queues holding ``waiting`` messages."""
    asks = []
    left = dict(waiting)
    while True:
        ask, sweep = next_ask(sweep)
        if ask is None:
            return asks
        got = min(ask.count, left[ask.queue])
        left[ask.queue] -= got
        asks.append((ask.queue, ask.count, got))
        sweep = record(sweep, ask, got)


@pytest.mark.parametrize("seed", range(40))
def test_the_script_makes_the_planners_asks_and_takes_what_each_brings(redis_queues, seed):
    conn, channel, make = redis_queues
    rng = random.Random(seed)
    queues = make(rng.randint(1, 6))
    names = [q.name for q in queues]
    waiting = {}
    for queue in queues:
        waiting[queue.name] = rng.randint(0, 5)
        publish(conn, queue, *[f"{queue.name}:{i}" for i in range(waiting[queue.name])])
    free = {name: rng.randint(0, 4) for name in names}
    room = rng.choice([None, *range(0, 11)])
    cursor = rng.choice([None, *names])
    sweep = begin_sweep(names, free, room, cursor)
    expected = planned(sweep, waiting)

    results = RedisFetcher(channel, ["json"]).claim_pass(sweep.to_ask, sweep.free, sweep.room)

    # The script reports the asks that took messages; the others took nothing.
    assert [(r.queue, r.count, r.taken) for r in results] == [a for a in expected if a[2] > 0]
    for result in results:
        taken = [m.decode() for m in result.messages]
        # Each queue gives its oldest messages first, and only what the ask took.
        assert len(taken) == result.taken
        assert all(body.startswith(f"{result.queue}:") for body in taken)
    client = redis.Redis.from_url(REDIS_URL)
    for name in names:
        took = sum(r.taken for r in results if r.queue == name)
        assert client.llen(name) == waiting[name] - took


@pytest.mark.parametrize("seed", range(10))
def test_among_many_empty_queues_the_script_still_makes_the_planners_asks(redis_queues, seed):
    # The script passes over stretches of 32 empty queues with one EXISTS: work
    # on either side of a stretch's edge, and at the very end, is still found.
    conn, channel, make = redis_queues
    rng = random.Random(seed)
    queues = make(70)
    names = [q.name for q in queues]
    loaded = set(rng.sample(range(70), 4)) | {31, 32, 69}
    waiting = {name: 0 for name in names}
    for index in loaded:
        waiting[names[index]] = rng.randint(1, 3)
        publish(conn, queues[index], *[f"{names[index]}:{i}" for i in range(waiting[names[index]])],
                priority=rng.choice([None, 9]))
    free = {name: rng.randint(0, 2) for name in names}
    room = rng.choice([None, 3, 8, 20])
    sweep = begin_sweep(names, free, room, rng.choice([None, *names]))
    expected = [a for a in planned(sweep, waiting) if a[2] > 0]

    results = RedisFetcher(channel, ["json"]).claim_pass(sweep.to_ask, sweep.free, sweep.room)

    assert [(r.queue, r.count, r.taken) for r in results] == expected
    assert expected, "the case must take something"


def test_every_message_a_pass_takes_is_recorded_unacked_as_kombu_restores_it(redis_queues):
    conn, channel, make = redis_queues
    a, b = make(2)
    publish(conn, a, "a1", "a2")
    publish(conn, b, "b1")
    results = RedisFetcher(channel, ["json"]).claim_pass([a.name, b.name], {a.name: 4, b.name: 4}, 3)
    client = redis.Redis.from_url(REDIS_URL)
    messages = [m for r in results for m in r.messages]
    assert sorted(m.decode() for m in messages) == ["a1", "a2", "b1"]
    by_name = {a.name: a, b.name: b}
    for message in messages:
        queue = by_name[a.name] if message.decode().startswith("a") else by_name[b.name]
        stored = json.loads(client.hget(channel.qos.unacked_key, message.delivery_tag))
        assert stored == [message._raw, queue.exchange.name, queue.routing_key]
        assert client.zscore(channel.qos.unacked_index_key, message.delivery_tag) is not None
        message.ack()
        assert client.hget(channel.qos.unacked_key, message.delivery_tag) is None


def test_higher_priority_messages_come_first_within_a_queue(redis_queues):
    conn, channel, make = redis_queues
    [queue] = make(1)
    publish(conn, queue, "low", priority=0)
    publish(conn, queue, "high", priority=9)
    [result] = RedisFetcher(channel, ["json"]).claim_pass([queue.name], {queue.name: 1}, 1)
    assert [m.decode() for m in result.messages] == [kombu_first_choice(conn, queue)]


def kombu_first_choice(conn, queue) -> str:
    # What kombu's own get would have taken first, from a fresh copy of the same two messages.
    probe = Queue(f"{queue.name}-probe", Exchange(f"{queue.name}-probe"), routing_key=f"{queue.name}-probe")
    with Connection(REDIS_URL) as other:
        probe(other.channel()).declare()
        publish(other, probe, "low", priority=0)
        publish(other, probe, "high", priority=9)
        message = probe(other.channel()).get(no_ack=True)
        first = message.decode()
        redis.Redis.from_url(REDIS_URL).delete(probe.name, *[f"{probe.name}\x06\x16{p}" for p in (3, 6, 9)],
                                               f"_kombu.binding.{probe.name}",
                                               f"_kombu.binding_permanent.{probe.name}")
    return first


def test_a_poison_item_is_parked_and_costs_the_pass_nothing(redis_queues):
    conn, channel, make = redis_queues
    [queue] = make(1)
    client = redis.Redis.from_url(REDIS_URL)
    client.lpush(queue.name, b"\xff not json")
    publish(conn, queue, "good")
    [result] = RedisFetcher(channel, ["json"]).claim_pass([queue.name], {queue.name: 2}, 2)
    assert [m.decode() for m in result.messages] == ["good"]
    assert result.taken == 1
    assert client.lrange(f"{queue.name}.durable.parked", 0, -1) == [b"\xff not json"]


@pytest.mark.parametrize("text", ["\ud800", "lone low \udc00 surrogate", "\udbff\udbff twice", "pair \U0001f600 ok"])
def test_a_message_kombu_sends_with_a_lone_surrogate_is_claimed_not_parked(redis_queues, text):
    """Celery's ``argsrepr`` header keeps a lone surrogate from the arguments (the body is base64 on
    Redis); kombu's JSON escapes it (``"\\ud800"``), which Python reads back and Redis's cjson refuses:
    the message is Celery-valid and must run, as a stock worker runs it."""
    conn, channel, make = redis_queues
    [queue] = make(1)
    client = redis.Redis.from_url(REDIS_URL)
    publish(conn, queue, {"arg": text}, headers={"argsrepr": repr((text,)), "kept": text})
    publish(conn, queue, "after")
    [result] = RedisFetcher(channel, ["json"]).claim_pass([queue.name], {queue.name: 2}, 2)
    assert [m.decode() for m in result.messages] == [{"arg": text}, "after"]
    assert client.llen(f"{queue.name}.durable.parked") == 0
    assert result.messages[0].headers["kept"] == text
    for message in result.messages:
        # Recorded unacked as kombu's restore reads it: the item, its exchange and routing key.
        stored = json.loads(client.hget(channel.qos.unacked_key, message.delivery_tag))
        assert stored == [message._raw, queue.exchange.name, queue.routing_key]
        message.ack()
