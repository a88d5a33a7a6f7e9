"""How a database URL appears in an error or a log line: never with its password."""

from __future__ import annotations

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
