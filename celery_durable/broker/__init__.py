"""The PostgreSQL broker: a kombu transport whose messages are rows of the durable store's database."""

from __future__ import annotations

from celery_durable.compat.transport_alias import register_transport_alias

#: ``durable+postgresql://…``: the transport alias of kombu's ``transport+url`` convention.
TRANSPORT_ALIAS = "durable"
TRANSPORT_PATH = "celery_durable.broker.transport:Transport"


def register() -> None:
    """Make ``durable+<database url>`` broker URLs resolve to this transport (idempotent)."""
    register_transport_alias(TRANSPORT_ALIAS, TRANSPORT_PATH)
