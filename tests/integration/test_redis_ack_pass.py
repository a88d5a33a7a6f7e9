"""An ack made while a claim pass is coming (a finished run's late ack) rides in it: one Redis round trip for both."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue

from celery_durable.compat import redis_claim
from celery_durable.worker.fetchers import AckCarrier, RedisFetcher
from tests.services import REDIS_URL, redis_problem, require


class Setup:
    def __init__(self, conn: Connection, channel: Any, queue: Queue, own: dict[str, str], held_key: str) -> None:
        self.conn, self.channel, self.queue, self.own, self.held_key = conn, channel, queue, own, held_key
        self.client = redis.Redis.from_url(REDIS_URL)
        #: What the claimer answers: a pass is kicked and not run yet.
        self.pass_coming = True
        self.fetcher = RedisFetcher(channel, ["json"], held_key=held_key)
        self.fetcher.carry_acks(lambda: self.pass_coming)

    def publish(self, *bodies: str) -> None:
        producer = self.conn.Producer()
        for body in bodies:
            producer.publish(body, exchange=self.queue.exchange, routing_key=self.queue.routing_key,
                             serializer="json", declare=[self.queue])

    def claim(self, count: int) -> list[Any]:
        name = self.queue.name
        asks = self.fetcher.claim_pass([name], {name: count}, count)
        return [message for ask in asks for message in ask.messages]

    def unacked(self) -> set[str]:
        return {tag.decode() for tag in self.client.hkeys(self.own["unacked_key"])}

    def indexed(self) -> set[str]:
        return {tag.decode() for tag in self.client.zrange(self.own["unacked_index_key"], 0, -1)}

    def held(self) -> set[str]:
        return {tag.decode() for tag in self.client.zrange(self.held_key, 0, -1)}

    def waiting(self) -> int:
        return int(self.client.llen(self.queue.name))


@pytest.fixture
def setup() -> Iterator[Setup]:
    require("Redis", redis_problem())
    tag = f"ackpass-{uuid.uuid4().hex[:8]}"
    # Unacked records of the test's own, apart from db 0's shared ones (other tests restore from them).
    own = {"unacked_key": f"{tag}.unacked", "unacked_index_key": f"{tag}.unacked_index",
           "unacked_mutex_key": f"{tag}.unacked_mutex"}
    held_key = f"{tag}.unacked.durable_held.me"
    name = f"{tag}-q"
    with Connection(REDIS_URL, transport_options=own) as conn:
        channel = conn.channel()
        queue = Queue(name, Exchange(name), routing_key=name)
        queue(channel).declare()
        yield Setup(conn, channel, queue, own, held_key)
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(name, *[f"{name}\x06\x16{p}" for p in (3, 6, 9)], f"_kombu.binding.{name}", held_key,
                  *own.values())


def test_the_redis_fetcher_carries_acks(setup):
    assert isinstance(setup.fetcher, AckCarrier)


def test_an_ack_made_while_a_pass_is_coming_goes_in_that_passs_one_round_trip(setup):
    setup.publish("a", "b", "c", "d")
    first, second, third = setup.claim(3)
    tags = {first.delivery_tag, second.delivery_tag, third.delivery_tag}
    assert setup.unacked() == setup.indexed() == setup.held() == tags

    first.ack()
    second.ack()
    # Acked in the channel's memory (the message is settled for Celery), not yet in Redis.
    assert first.acknowledged and second.acknowledged
    assert setup.unacked() == tags

    trips = setup.fetcher.round_trips
    (fourth,) = setup.claim(1)
    assert setup.fetcher.round_trips == trips + 1
    # The pass removed both acks' records (hash, index, held set) and recorded what it claimed.
    left = {third.delivery_tag, fourth.delivery_tag}
    assert setup.unacked() == setup.indexed() == setup.held() == left


def test_acks_ride_a_pass_that_claims_nothing(setup):
    setup.publish("a")
    (message,) = setup.claim(1)
    message.ack()
    assert setup.claim(1) == []
    assert setup.unacked() == setup.indexed() == setup.held() == set()


@pytest.mark.parametrize("why", ["no pass coming", "another thread"])
def test_an_ack_no_pass_is_coming_for_goes_to_redis_at_once(setup, why):
    setup.publish("a")
    (message,) = setup.claim(1)
    if why == "no pass coming":
        setup.pass_coming = False  # nothing kicked one (an early ack of a long run), or the claimer stopped
        message.ack()
    else:
        thread = threading.Thread(target=message.ack)
        thread.start()
        thread.join()
    assert message.acknowledged
    assert setup.unacked() == setup.indexed() == set()


def test_acks_no_pass_carried_are_sent_on_their_own(setup):
    setup.publish("a", "b")
    first, second = setup.claim(2)
    first.ack()
    trips = setup.fetcher.round_trips
    setup.fetcher.send_acks()
    assert setup.unacked() == setup.indexed() == setup.held() == {second.delivery_tag}
    assert setup.fetcher.round_trips == trips  # not a claim
    setup.fetcher.send_acks()  # nothing left: nothing sent
    assert setup.unacked() == {second.delivery_tag}


def test_a_pass_that_failed_leaves_its_acks_to_be_sent_on_their_own(setup, monkeypatch):
    setup.publish("a")
    (message,) = setup.claim(1)
    message.ack()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise redis.exceptions.ConnectionError("lost")

    monkeypatch.setattr(redis_claim, "claim_pass", broken)
    with pytest.raises(redis.exceptions.ConnectionError):
        setup.claim(1)
    assert setup.unacked() == {message.delivery_tag}
    setup.fetcher.send_acks()
    assert setup.unacked() == setup.indexed() == setup.held() == set()


def test_a_channel_closed_before_the_pass_does_not_put_an_acked_message_back(setup):
    """kombu restores what a closing channel still holds unacked in memory: an ack waiting for its pass is
    not held there any more, so the finished run's message is not queued again."""
    setup.publish("a", "b")
    first, second = setup.claim(2)
    first.ack()
    setup.channel.close()
    assert setup.waiting() == 1  # the unacked one went back; the acked one did not
    assert first.delivery_tag in setup.unacked()  # its record waits for send_acks (the claimer's stop)
    setup.fetcher.send_acks()
    assert first.delivery_tag not in setup.unacked()
