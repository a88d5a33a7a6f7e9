"""Registering a kombu transport alias, so ``alias+<url>`` broker URLs resolve to our transport."""

from __future__ import annotations

import logging

from kombu import transport

logger = logging.getLogger(__name__)


def register_transport_alias(alias: str, path: str) -> None:
    """Make ``Connection("alias+<url>")`` (and ``broker_url``) load the transport class at ``path``.

    Relies on ``kombu.transport.TRANSPORT_ALIASES``, the module dict
    ``resolve_transport`` reads (kombu 4.x and 5.x; third-party transports
    are told to add themselves there). kombu splits ``alias+url`` at the first
    ``+`` and hands the rest to the transport as the connection's hostname.
    """
    current = transport.TRANSPORT_ALIASES.get(alias)
    if current not in (None, path):
        logger.warning("durable.boot.transport_alias_conflict: transport alias %r was %r; replacing it",
                       alias, current,
                       extra={"event": "durable.boot.transport_alias_conflict", "alias": alias, "was": repr(current)})
    transport.TRANSPORT_ALIASES[alias] = path
