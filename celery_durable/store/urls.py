"""How a database URL appears in an error or a log line: never with its password."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc


def shown_url(url: str | sa.engine.URL) -> str:
    """``url`` with its password as ``***``, for messages and logs.

    A string SQLAlchemy cannot parse (a setting with a typo) cannot have its
    password hidden by SQLAlchemy: what could be one, between the user's ':'
    and the last '@', is hidden by hand.
    """
    if isinstance(url, sa.engine.URL):
        return url.render_as_string(hide_password=True)
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except (exc.ArgumentError, ValueError):
        return _masked(url)


def _masked(raw: str) -> str:
    scheme, sep, rest = raw.partition("://") if "://" in raw else ("", "", raw)
    if "@" in rest:
        userinfo, _, after = rest.rpartition("@")
        if ":" in userinfo:
            rest = f"{userinfo.split(':', 1)[0]}:***@{after}"
    return f"{scheme}{sep}{rest}"


def rendered(url: sa.engine.URL, *, hide_password: bool = False) -> str:
    """``url.render_as_string``, once per URL object: an engine keeps its URL for life, and rendering
    (quoting every part) cost ~15 µs each time a run's statements looked up their engine or clock."""
    seen = _RENDERED.get((id(url), hide_password))
    if seen is None or seen[0] is not url:
        if len(_RENDERED) > 256:
            _RENDERED.clear()  # a process makes few engines: more is a leak to cut, not a working set
        seen = _RENDERED[(id(url), hide_password)] = (url, url.render_as_string(hide_password=hide_password))
    return seen[1]


_RENDERED: dict[tuple[int, bool], tuple[sa.engine.URL, str]] = {}


#: A PostgreSQL broker URL: kombu's ``transport+url``, ``durable`` being the alias install() registers.
BROKER_SCHEME_PREFIX = "durable+"


def broker_database(broker_url: Any) -> str | None:
    """The database URL inside a ``durable+<database url>`` broker URL; None for any other broker."""
    if isinstance(broker_url, str) and broker_url.startswith(BROKER_SCHEME_PREFIX):
        return broker_url[len(BROKER_SCHEME_PREFIX):]
    return None

