"""The status screen, from a snapshot: what an operator reads first, and what could not be read."""

from __future__ import annotations

from celery_durable.cli.status_view import FleetSnapshot, QueueView, WorkerView, render


def test_the_screen_shows_workers_queues_runs_and_outbox_in_that_order():
    snapshot = FleetSnapshot(
        workers=[WorkerView("w1@h", 3, 4, {"a": 2, "b": 1}, {"a": 2, "b": 8})],
        queues=[QueueView("a", 12, 4.25, 0), QueueView("b", 0, 0.0, 2), QueueView("gone", None, None, 0)],
        runs_by_state={"running": 3, "dead": 2, "succeeded": 40},
        outbox_backlog=5, outbox_oldest_seconds=7200.0,
    )
    screen = render(snapshot).splitlines()
    assert screen[0] == "WORKERS  1 answering, 3/4 in flight"
    assert screen[1].split() == ["w1@h", "3/4", "a", "2/2,", "b", "1/8"]
    assert [line.split() for line in screen[4:7]] == [["a", "12", "4.2s", "0"], ["b", "0", "0.0s", "2"],
                                                      ["gone", "-", "-", "0"]]
    assert "RUNS     dead 2  running 3  succeeded 40" in screen
    assert "OUTBOX   5 unpublished, oldest 2.0h" in screen
    assert not any(line.startswith("!") for line in screen)


def test_what_could_not_be_read_is_its_own_line_and_the_rest_still_shows():
    snapshot = FleetSnapshot(runs_by_state={"dead": 1}, problems=["the broker could not be read: refused"])
    screen = render(snapshot)
    assert "(no -P durable worker answered)" in screen and "RUNS     dead 1" in screen
    assert screen.endswith("! the broker could not be read: refused")
    assert FleetSnapshot(problems=["x"]).as_json()["problems"] == ["x"]


def test_the_queue_columns_sit_under_their_headers():
    snapshot = FleetSnapshot(queues=[QueueView("reports", 1234, 65.0, 7)], runs_by_state={}, outbox_backlog=0)
    header, row = [line for line in render(snapshot).splitlines() if "depth" in line or "reports" in line]
    for title, value in (("depth", "1234"), ("oldest ready", "65.0s"), ("dead runs", "7")):
        assert header.index(title) + len(title) == row.index(value) + len(value), (title, header, row)


def test_a_store_that_could_not_be_read_shows_only_its_line_not_empty_runs():
    snapshot = FleetSnapshot(queues=[QueueView("a", 3, 1.0, 0)], store_unread=True,
                             problems=["the store could not be read: connection refused"])
    screen = render(snapshot)
    assert "RUNS" not in screen and "OUTBOX" not in screen
    assert screen.splitlines()[-1] == "! the store could not be read: connection refused"
    [row] = [line for line in screen.splitlines() if line.startswith("  a ")]
    assert row.split()[-1] == "-"  # its dead runs are not known, not 0


def test_a_worker_serving_metrics_shows_its_port():
    snapshot = FleetSnapshot(workers=[WorkerView("w1@h", 0, 2, {}, {"a": 2}, 9101), WorkerView("w2@h", 0, 2, {}, {})])
    lines = render(snapshot).splitlines()
    assert lines[1].endswith("metrics :9101") and "metrics" not in lines[2]
