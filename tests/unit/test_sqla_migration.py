"""broker.sqla_migration.outgoing_of: an old sqla+ message as a row of the broker that claims rows."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from celery_durable.broker.sqla_migration import outgoing_of

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=timezone.utc).timestamp()


def test_the_message_is_kept_whole_with_its_priority_bounded_to_0_9() -> None:
    message = {"body": "e30=", "headers": {"task": "t"}, "properties": {"priority": 12, "delivery_tag": "x"}}
    moved = outgoing_of("default", json.dumps(message), NOW)
    assert moved is not None
    assert (moved.queue, moved.payload, moved.priority, moved.delay) == ("default", message, 9, 0.0)
    assert outgoing_of("q", json.dumps({"properties": {"priority": "high"}}), NOW).priority == 0  # type: ignore[union-attr]


def test_a_countdown_keeps_what_is_left_of_it() -> None:
    eta = datetime(2026, 12, 6, 12, 0, 30, tzinfo=timezone.utc).isoformat()
    moved = outgoing_of("q", json.dumps({"headers": {"eta": eta}, "properties": {}}), NOW)
    assert moved is not None and moved.delay == 30.0


def test_a_payload_that_is_not_a_kombu_message_is_not_moved() -> None:
    assert outgoing_of("q", "not json", NOW) is None
    assert outgoing_of("q", "[1, 2]", NOW) is None
