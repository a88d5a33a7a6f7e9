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
