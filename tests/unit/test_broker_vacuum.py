"""When a claiming worker VACUUMs the broker's table (broker/vacuum.py's pure plan)."""

from __future__ import annotations

import pytest

from celery_durable.broker.transport import vacuum_dead_rows
from celery_durable.broker.vacuum import VacuumPlan
from celery_durable.errors import ConfigInvalid


def test_a_vacuum_is_due_once_the_threshold_of_dead_rows_piled_up():
    plan = VacuumPlan(1000)
    assert not plan.due(0)
    assert not plan.due(999)
    assert plan.due(1000)


def test_dead_rows_a_vacuum_could_not_remove_do_not_count_toward_the_next():
    # An open transaction kept 800 of them: a plan counting from zero would VACUUM again at once.
    plan = VacuumPlan(1000).after_vacuum(800)
    assert not plan.due(800)
    assert not plan.due(1799)
    assert plan.due(1800)


def test_a_threshold_of_zero_never_vacuums():
    assert not VacuumPlan(0).due(10**9)


def test_the_transport_option_wins_over_the_apps_setting_and_is_checked_the_same_way():
    assert vacuum_dead_rows({"durable_broker_vacuum_dead_rows": 0}) == 0
    assert vacuum_dead_rows({"durable_broker_vacuum_dead_rows": 250}) == 250
    with pytest.raises(ConfigInvalid, match="durable_broker_vacuum_dead_rows must be a whole number >= 0"):
        vacuum_dead_rows({"durable_broker_vacuum_dead_rows": -5})
