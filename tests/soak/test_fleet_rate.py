"""The fleet rate limit at full scale (issue 11, rule 5): ``"100/m"`` across 3 workers for 60 seconds.

Deselected by default; ``CI=true pytest -m soak tests/soak/test_fleet_rate.py -s`` shows the figures.
The CI suite runs the same scenario at ten times the rate for a tenth of the time
(tests/e2e/test_fleet_limits.py).
"""

from __future__ import annotations

import pytest

from tests.e2e.durable_support import conf, durable_scenario  # noqa: F401 - durable_scenario is a fixture
from tests.e2e.harness import wait_for

pytestmark = pytest.mark.soak


@pytest.mark.parametrize(("store_kind", "workers_count"), [("postgresql", 3), ("sqlite", 1)])
def test_100_a_minute_across_the_fleet_for_a_minute(durable_scenario, monkeypatch, store_kind, workers_count):
    s, url = durable_scenario(store_kind, "redis")
    monkeypatch.setenv("E2E_RATE", "100/m")
    workers = [s.worker(app="tests.e2e.limitsapp", conf=conf(url), queues=["q"], concurrency=4)
               for _ in range(workers_count)]
    for worker in workers:
        worker.wait_ready()
    for i in range(160):
        s.send_task("q", "limits.partner", [f"r{i}"])
    wait_for(lambda: len(s.labelled("start", "r")) >= 105, timeout=120, what="105 rate-limited runs to start")
    starts = sorted(e["t"] for e in s.labelled("start", "r"))
    window = [t for t in starts if t < starts[0] + 60.0]
    per_second: dict[int, int] = {}
    for t in window:
        per_second[int(t - starts[0])] = per_second.get(int(t - starts[0]), 0) + 1
    gaps = sorted(b - a for a, b in zip(window, window[1:]))
    print(f"\n100/m on {store_kind} x{workers_count}: {len(window)} starts in 60 s; most in one second "
          f"{max(per_second.values())}; gap p50 {gaps[len(gaps) // 2] * 1000:.0f} ms, min {gaps[0] * 1000:.0f} ms, "
          f"max {gaps[-1] * 1000:.0f} ms; by worker "
          f"{sorted(w.durable_stats()['limits_waited'] for w in workers)} parked")
    assert 98 <= len(window) <= 102, len(window)
    assert max(per_second.values()) <= 3, per_second
