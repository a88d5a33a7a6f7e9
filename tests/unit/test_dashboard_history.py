"""The dashboard's last minutes: samples as aligned series, the oldest falling off the window."""

from __future__ import annotations

from celery_durable.cli.dashboard_history import History
from celery_durable.cli.status_view import FleetSnapshot, QueueView, WorkerView


def _snapshot(workers: dict[str, int], depth: int | None) -> FleetSnapshot:
    return FleetSnapshot(workers=[WorkerView(name, n, 4, {}, {}) for name, n in workers.items()],
                         queues=[QueueView("q", depth, None if depth is None else 1.5, 0)])


def test_series_are_aligned_with_time_and_a_worker_that_came_later_has_nulls_before():
    history = History(window=60)
    history.add(100.0, _snapshot({"w1": 1}, 3))
    history.add(102.0, _snapshot({"w1": 2, "w2": 4}, None))
    series = history.series()
    assert series["t"] == [100.0, 102.0]
    assert series["workers"]["w1"] == {"in_flight": [1, 2], "capacity": [4, 4]}
    assert series["workers"]["w2"] == {"in_flight": [None, 4], "capacity": [None, 4]}
    assert series["queues"]["q"] == {"depth": [3, None], "oldest": [1.5, None]}


def test_samples_older_than_the_window_fall_off():
    history = History(window=10)
    for at in (0.0, 5.0, 11.0, 16.0):
        history.add(at, _snapshot({"w1": 1}, 0))
    assert history.series()["t"] == [11.0, 16.0]
