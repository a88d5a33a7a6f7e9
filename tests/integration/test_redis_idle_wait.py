"""The Redis idle wait on a real Redis and kombu's hub: it wakes on a message and takes nothing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue
from kombu.asynchronous import Hub

from celery_durable.compat.redis_claim import prefixed_priority_lists
from celery_durable.worker.redis_idle_wait import RedisIdleWait
from tests.e2e.harness import wait_for
from tests.services import REDIS_URL, redis_problem, require

pytestmark = pytest.mark.redis


class Watched:
    """A queue of the test's own, a hub, and the idle wait watching the queue."""

    def __init__(self) -> None:
        self.name = f"idle-{uuid.uuid4().hex[:8]}"
        self.conn = Connection(REDIS_URL)
        self.channel = self.conn.channel()
        self.queue = Queue(self.name, Exchange(self.name), routing_key=self.name)
        self.queue(self.channel).declare()
        self.client = redis.Redis.from_url(REDIS_URL)
        self.hub = Hub()
        self.woken = 0
        self.wait = RedisIdleWait(self.channel, self.hub, self._woken)
        self._loop = self.hub.create_loop()

    def _woken(self) -> None:
        self.woken += 1

    def publish(self, body: str, priority: int | None = None) -> None:
        self.conn.Producer().publish(body, exchange=self.queue.exchange, routing_key=self.name,
                                     serializer="json", priority=priority)

    def turn_until(self, condition: Any, what: str) -> None:
        def turned() -> Any:
            next(self._loop)
            return condition()
        wait_for(turned, timeout=10, what=what, every=0)

    def depth(self) -> int:
        return sum(self.client.llen(key) for key in prefixed_priority_lists(self.channel, self.name))

    def close(self) -> None:
        self.wait.close()
        self.hub.close()
        self.client.delete(*prefixed_priority_lists(self.channel, self.name))
        self.client.close()
        self.conn.close()


@pytest.fixture
def watched() -> Iterator[Watched]:
    require("Redis", redis_problem())
    made = Watched()
    yield made
    made.close()


def test_a_message_wakes_the_wait_and_stays_on_its_list_for_the_claim(watched: Watched) -> None:
    watched.wait.arm([watched.name])
    assert watched.wait.waiting_on == {watched.name}
    watched.publish("hello")
    watched.turn_until(lambda: watched.woken == 1, "the wait to wake on the message")
    # Woken, and nothing taken: a worker killed now leaves the message where it was.
    assert watched.depth() == 1
    assert watched.wait.wakes == 1


def test_a_message_of_any_priority_wakes_the_wait(watched: Watched) -> None:
    watched.wait.arm([watched.name])
    watched.publish("urgent", priority=9)
    watched.turn_until(lambda: watched.woken == 1, "the wait to wake on a priority-9 message")
    assert watched.depth() == 1


def test_an_answer_after_disarm_only_kicks_and_is_not_asked_again(watched: Watched) -> None:
    watched.wait.arm([watched.name])
    watched.wait.disarm()
    assert watched.wait.waiting_on == set()
    watched.publish("late")
    # The peek sent before the disarm still answers: one kick, which finds the message or no room.
    watched.turn_until(lambda: watched.woken == 1, "the peek sent before the disarm to answer")
    # Arming again sends a new peek, which the message still there answers at once.
    watched.wait.arm([watched.name])
    watched.turn_until(lambda: watched.woken == 2, "the new peek to answer")
    assert watched.depth() == 1


def test_more_queues_than_the_connection_budget_are_not_armed_and_it_says_so_once(watched: Watched,
                                                                                   caplog: Any) -> None:
    from celery_durable.worker.redis_idle_wait import MAX_PEEK_LISTS

    per_queue = len(prefixed_priority_lists(watched.channel, watched.name))
    too_many = [watched.name, *[f"other{i}" for i in range(MAX_PEEK_LISTS // per_queue)]]
    with caplog.at_level("WARNING", logger="celery_durable.worker.redis_idle_wait"):
        assert not watched.wait.arm(too_many)
        assert not watched.wait.arm(too_many)
    assert watched.wait.waiting_on == set()
    said = [r.message for r in caplog.records if "durable.idle.redis_too_many_lists" in r.message]
    assert len(said) == 1
    # Within the budget it arms, and a message wakes it.
    assert watched.wait.arm(too_many[:-1])
    watched.publish("hello")
    watched.turn_until(lambda: watched.woken == 1, "the wait within its budget to wake")
