"""Rule 3 of fleet limits held to its figure on a quiet machine: B's runs start within a second.

Deselected by default; ``CI=true pytest -m soak tests/soak -s`` prints the figures. Three rounds per
broker; the CI suite holds the same scenario to its property (B runs while A's wait).
"""

from __future__ import annotations

import pytest

from tests.e2e.durable_support import durable_scenario  # noqa: F401 - durable_scenario is a fixture
from tests.e2e.test_fleet_limits import busy_key_scenario

pytestmark = pytest.mark.soak


@pytest.mark.parametrize("round_", [1, 2, 3])
@pytest.mark.parametrize("broker_kind", ["redis", "rabbitmq"])
def test_other_keys_start_within_a_second_behind_a_flood_of_one_key(durable_scenario, broker_kind, round_):
    s, url = durable_scenario("postgresql", broker_kind)
    b_latency, a_ended_before, _ = busy_key_scenario(s, url)
    print(f"\nrule 3 ({broker_kind}, round {round_}): B started {b_latency[0] * 1000:.0f}-"
          f"{b_latency[-1] * 1000:.0f} ms after it was sent; {a_ended_before} of A's had run")
    assert b_latency[-1] < 1.0, b_latency
