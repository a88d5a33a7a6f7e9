"""Fixtures of the compat contract tests: a Celery app on kombu's memory transport and the task messages it sends."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Queue

from celery_durable.worker.parking import parked_name


def unique(prefix: str) -> str:
    """A queue or key name no other test, run or project uses (they share one Redis and RabbitMQ)."""
    return f"compat-{prefix}-{uuid.uuid4().hex[:10]}"


def redis_keys_of(queue: str, prefix: str = "") -> list[str]:
    """Every key kombu's Redis transport (and parking) makes for ``queue`` bound to an exchange of its name.

    ``prefix``: the transport's ``global_keyprefix``, if it has one.
    """
    keys = [queue, *[f"{queue}\x06\x16{p}" for p in (3, 6, 9)], parked_name(queue),
            f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}"]
    return [f"{prefix}{key}" for key in keys]


def delete_redis_queues(client: Any, queues: list[str], prefix: str = "") -> None:
    if queues:
        client.delete(*[key for queue in queues for key in redis_keys_of(queue, prefix)])
        # An expiring queue's exchange is listed for kombu's sweep of stale bindings.
        client.zrem(f"{prefix}_kombu.binding_deadlines", *queues)


@pytest.fixture
def app() -> Iterator[Celery]:
    """A Celery app of protocol 2 on ``memory://``, with a plain task and a rate-limited one."""
    app = Celery("compat", broker="memory://", set_as_current=False)
    app.conf.task_protocol = 2

    @app.task(name="compat.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="compat.mul", shared=False)
    def mul(x: int, y: int) -> int:
        return x * y

    @app.task(name="compat.limited", rate_limit="100/s", shared=False)
    def limited(x: int) -> int:
        return x

    yield app
    app.close()


TaskMessage = Callable[..., Any]


@pytest.fixture
def task_message(app: Celery) -> Iterator[TaskMessage]:
    """``task_message(sig, **apply_async_options)``: the kombu Message Celery sends for ``sig``, as a worker gets it.

    Published by Celery itself to a queue of the test's own on ``memory://``,
    then taken unacked, so the message can be acked or rejected.
    """
    conn = Connection("memory://")
    names: list[str] = []

    def make(sig: Any, **options: Any) -> Any:
        name = unique("memory")
        names.append(name)
        sig.apply_async(queue=name, connection=conn, **options)
        message = Queue(name)(conn.default_channel).get(no_ack=False)
        assert message is not None, "Celery's publish did not reach the memory transport"
        return message

    yield make
    conn.close()
    with Connection("memory://") as cleanup:
        for name in names:
            cleanup.default_channel.queue_delete(name)
