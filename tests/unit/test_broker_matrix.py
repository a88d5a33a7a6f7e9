"""The e2e broker matrix (tests/conftest.py) names files that exist: a renamed core file must not drop to one broker."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ALL_BROKERS, CORE_E2E_FILES, DEFAULT_BROKER, MESSAGE_BROKERS, ROW_BROKERS

E2E = Path(__file__).resolve().parents[1] / "e2e"


def test_every_core_e2e_file_exists():
    assert sorted(name for name in CORE_E2E_FILES if not (E2E / name).is_file()) == []


def test_every_broker_is_in_one_list_and_the_default_is_a_message_broker():
    assert ALL_BROKERS == [*MESSAGE_BROKERS, *ROW_BROKERS]
    assert len(set(ALL_BROKERS)) == len(ALL_BROKERS)
    assert DEFAULT_BROKER in MESSAGE_BROKERS
