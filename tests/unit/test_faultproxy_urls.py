"""The fault proxy's URL rewriting: only host and port change, everything else byte for byte."""

from __future__ import annotations

import pytest

from tests.faultproxy import rewrite_url, url_target


@pytest.mark.parametrize(("url", "expected"), [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:40001/0"),
    ("redis://localhost/15", "redis://127.0.0.1:40001/15"),
    ("redis://:secret@127.0.0.1:6379/2", "redis://:secret@127.0.0.1:40001/2"),
    ("amqp://guest:guest@127.0.0.1:5672//", "amqp://guest:guest@127.0.0.1:40001//"),
    ("amqp://guest:guest@127.0.0.1//", "amqp://guest:guest@127.0.0.1:40001//"),
    ("amqp://u:p%40ss@broker:5672/vhost?heartbeat=10", "amqp://u:p%40ss@127.0.0.1:40001/vhost?heartbeat=10"),
    ("postgresql+psycopg2://postgres@127.0.0.1:5432/test",
     "postgresql+psycopg2://postgres@127.0.0.1:40001/test"),
    # The per-test schema travels in an encoded query: never decoded, never re-encoded.
    ("postgresql+psycopg2://postgres@127.0.0.1:5432/test?options=-csearch_path%3Ddurable_t_abc",
     "postgresql+psycopg2://postgres@127.0.0.1:40001/test?options=-csearch_path%3Ddurable_t_abc"),
])
def test_rewrite_keeps_everything_but_host_and_port(url: str, expected: str) -> None:
    assert rewrite_url(url, "127.0.0.1", 40001) == expected


@pytest.mark.parametrize(("url", "target"), [
    ("redis://127.0.0.1:6379/0", ("127.0.0.1", 6379)),
    ("redis://localhost/0", ("localhost", 6379)),
    ("amqp://guest:guest@127.0.0.1//", ("127.0.0.1", 5672)),
    ("pyamqp://guest:guest@host:5673//", ("host", 5673)),
    ("postgresql+psycopg2://postgres@127.0.0.1/test?options=x", ("127.0.0.1", 5432)),
])
def test_url_target_names_the_service(url: str, target: tuple[str, int]) -> None:
    assert url_target(url) == target


def test_a_scheme_without_a_known_port_must_give_one() -> None:
    with pytest.raises(ValueError, match="give the port"):
        url_target("mysql://db/x")
