"""job_worker_in_flight / job_worker_capacity: a live worker is counted, a stopped one leaves both gauges."""

from __future__ import annotations

from dataclasses import dataclass

from celery_durable.config import DurableConfig
from celery_durable.metrics import worker_gauges
from celery_durable.metrics.registry import REGISTRY


@dataclass
class FakeWorker:
    held: int
    cap: int

    def in_flight(self) -> int:
        return self.held

    def capacity(self) -> int:
        return self.cap


def gauges() -> tuple[float, float]:
    return (REGISTRY.get_sample_value("job_worker_in_flight") or 0.0,
            REGISTRY.get_sample_value("job_worker_capacity") or 0.0)


def test_a_registered_worker_is_read_at_scrape_time_and_a_stopped_one_drops_out():
    before = gauges()
    first, second = FakeWorker(held=1, cap=4), FakeWorker(held=2, cap=3)
    worker_gauges.register_worker(first, DurableConfig())
    worker_gauges.register_worker(second, DurableConfig())
    try:
        assert gauges() == (before[0] + 3, before[1] + 7)
        first.held = 4  # read at scrape time, not copied at registration
        assert gauges() == (before[0] + 6, before[1] + 7)
        worker_gauges.unregister_worker(first)
        assert gauges() == (before[0] + 2, before[1] + 3)
    finally:
        worker_gauges.unregister_worker(first)
        worker_gauges.unregister_worker(second)
    assert gauges() == before


def test_registering_twice_counts_once_and_unregistering_an_unknown_worker_is_harmless():
    before = gauges()
    worker = FakeWorker(held=1, cap=2)
    worker_gauges.register_worker(worker, DurableConfig())
    worker_gauges.register_worker(worker, DurableConfig())
    try:
        assert gauges() == (before[0] + 1, before[1] + 2)
    finally:
        worker_gauges.unregister_worker(worker)
        worker_gauges.unregister_worker(worker)
    assert gauges() == before
