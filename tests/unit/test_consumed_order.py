"""worker/consumed_order.py: the pass's queues, rebuilt only when the consumed or held queues change."""

from __future__ import annotations

from kombu import Queue

from celery_durable.worker.consumed_order import ConsumedOrder


def test_quorum_and_stream_queues_are_not_pushable_and_the_set_follows_the_consumed_queues():
    consumed = [Queue("classic"), Queue("qq", queue_arguments={"x-queue-type": "quorum"}),
                Queue("st", queue_arguments={"x-queue-type": "stream"})]
    order = ConsumedOrder(lambda: consumed, lambda: ("qq", "classic", "st"))
    by_name, held_order = order.read()
    assert set(by_name) == {"classic", "qq", "st"} and held_order == ("qq", "classic", "st")
    assert order.pushable == {"classic"}
    consumed = [Queue("qq", queue_arguments={"x-queue-type": "quorum"}), Queue("other")]
    order.read()
    assert order.pushable == {"other"}
