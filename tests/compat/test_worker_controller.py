"""compat.worker_controller on Celery's own WorkController: a pool, consumer and size set at worker_init are built."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, signals
from celery._state import _set_task_join_will_block, task_join_will_block
from celery.concurrency.solo import TaskPool as SoloPool
from celery.concurrency.thread import TaskPool as ThreadPool
from celery.worker import WorkController
from celery.worker.consumer import Consumer

from celery_durable.compat import worker_controller as controller
from celery_durable.errors import HostIncompatible
from celery_durable.worker import boot

WORKER_INIT_UID = "celery_durable.worker_init"  # boot.register's


class MarkedConsumer(Consumer):  # type: ignore[misc]
    """A consumer the test can tell from Celery's."""


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("compat-controller", broker="memory://", set_as_current=False)
    # Only the test's own worker_init receiver: celery_durable's would wire (or refuse) this worker itself.
    signals.worker_init.disconnect(dispatch_uid=WORKER_INIT_UID)
    # Building a worker's pool marks the whole process as a worker's (result.get() refused in it): a later
    # test in this process that runs tasks eagerly and waits on them must not inherit that.
    joins_blocked = task_join_will_block()
    try:
        yield app
    finally:
        _set_task_join_will_block(joins_blocked)
        signals.worker_init.connect(boot._wire_durable_worker, weak=False, dispatch_uid=WORKER_INIT_UID)
        app.close()


def _built(app: Celery, on_init: Any, **options: Any) -> WorkController:
    """A WorkController built (not started) with ``on_init`` connected to ``worker_init``."""
    seen: list[Any] = []

    def receiver(sender: Any = None, **_: Any) -> None:
        seen.append(sender)
        on_init(sender)

    signals.worker_init.connect(receiver, weak=False)
    try:
        worker = app.WorkController(pool_cls="solo", concurrency=3, **options)
    finally:
        signals.worker_init.disconnect(receiver)
    assert seen == [worker]
    return worker


def test_pool_consumer_and_size_set_at_worker_init_are_what_the_worker_builds(app: Celery) -> None:
    read: dict[str, Any] = {}

    def wire(worker: Any) -> None:
        assert controller.missing_on(worker) == []
        read["pool"], read["size"] = controller.pool_of(worker), controller.pool_size(worker)
        controller.use_pool(worker, "celery.concurrency.thread:TaskPool")
        controller.use_consumer(worker, f"{__name__}:MarkedConsumer")
        controller.size_pool(worker, 2)

    worker = _built(app, wire)
    assert read == {"pool": "solo", "size": 3}
    assert controller.pool_of(worker) is ThreadPool
    assert worker.concurrency == 2
    # The bootsteps build from the worker's attributes: the consumer class and the pool's limit.
    worker.blueprint.apply(worker)
    assert isinstance(worker.consumer, MarkedConsumer)
    assert isinstance(worker.pool, ThreadPool) and worker.pool.limit == 2


def test_a_worker_left_alone_builds_what_it_was_given(app: Celery) -> None:
    worker = _built(app, lambda worker: None)
    assert controller.pool_of(worker) is SoloPool


def test_check_worker_refuses_a_worker_lacking_an_attribute_naming_it() -> None:
    class Bare:
        pool_cls = "solo"
        concurrency = 1

    with pytest.raises(HostIncompatible, match=r"WorkController\.consumer_cls"):
        controller.check_worker(Bare())
