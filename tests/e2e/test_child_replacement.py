"""A prefork child recycled by ``--max-tasks-per-child`` is replaced at once.

The child's exit can reach the worker before the kernel lets it be reaped; a
worker that does not look again leaves the next task waiting for Celery's
5 s pool check, on every broker.
"""

from __future__ import annotations

#: Short tasks in a row, each in a fresh child.
TASKS = 8
#: Largest gap allowed between two task starts. A replacement takes ~0.2 s
#: (one fork); a missed exit costs up to 5 s. Margin for a loaded 2-core box.
MAX_GAP_SECONDS = 2.0


def test_the_next_task_starts_as_soon_as_the_recycled_child_is_replaced(scenario):
    s = scenario(["q"])
    worker = s.worker(concurrency=1, extra_args=["--max-tasks-per-child", "1"]).wait_ready()
    for i in range(TASKS):
        s.send("q", f"t{i}", 0.0)
    s.wait_ended(TASKS, timeout=90)

    started = sorted(s.started(), key=lambda e: e["t"])
    assert len({e["pid"] for e in started}) == TASKS, "each task must have run in a fresh child"
    gaps = [round(b["t"] - a["t"], 2) for a, b in zip(started, started[1:])]
    assert max(gaps) < MAX_GAP_SECONDS, f"a task waited for its child's replacement: gaps {gaps}"

    # The slot each finished run freed was freed once: never two at once, nothing left held.
    assert s.max_concurrency() == 1
    worker.wait_durable(lambda st: st["in_flight"] == 0 and st["scheduled"] == 0, timeout=15,
                        what="every count back")
    assert worker.terminate() == 0


def test_recycled_children_each_run_one_task_and_none_is_lost_or_run_twice(scenario):
    # A job is written to an idle child's pipe as it is handed to the pool (compat/asynpool.py), in the
    # turn of the loop that read the last result of a child about to exit for --max-tasks-per-child: a
    # job written to a child that exits before reading it is put back by Celery and runs in another.
    s = scenario(["q"])
    worker = s.worker(concurrency=2, extra_args=["--max-tasks-per-child", "1"]).wait_ready()
    count = 30
    for i in range(count):
        s.send("q", f"t{i}", 0.0)
    s.wait_ended(count, timeout=120)
    started = s.started()
    assert sorted(e["label"] for e in started) == sorted(f"t{i}" for i in range(count))  # each ran once
    assert len({e["pid"] for e in started}) == count, "each task must have run in a fresh child"
    assert s.max_concurrency() <= 2
    worker.wait_durable(lambda st: st["in_flight"] == 0 and st["scheduled"] == 0, timeout=15,
                        what="every count back")
    log = worker.log()
    for sign in ("WorkerLostError", "exited prematurely", "inqueue damaged"):
        assert sign not in log, sign
    assert worker.terminate() == 0
