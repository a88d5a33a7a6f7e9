"""The Redis batch: consecutive pushes to one list coalesce into one LPUSH, order kept."""

from __future__ import annotations

from celery_durable.outbox.publishing.redis_pipeline import coalesce_pushes


def test_consecutive_pushes_to_one_list_become_one_push_in_the_same_order() -> None:
    commands = [("lpush", ("q", "m1")), ("lpush", ("q", "m2")), ("lpush", ("q\x06\x163", "p1")),
                ("pexpire", ("q", 1000)), ("lpush", ("q", "m3")), ("lpush", ("q", "m4"))]
    assert coalesce_pushes(commands) == [
        ("lpush", ("q", "m1", "m2")), ("lpush", ("q\x06\x163", "p1")), ("pexpire", ("q", 1000)),
        ("lpush", ("q", "m3", "m4")),
    ]
