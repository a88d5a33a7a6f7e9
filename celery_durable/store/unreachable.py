"""Which failures mean the durable store cannot be reached (an outage), as opposed to a bad statement or a bug."""

from __future__ import annotations

from sqlalchemy import exc

from celery_durable.errors import StoreUnavailable

#: What SQLAlchemy raises when the database does not answer: no connection, a connection lost, the
#: server refusing work (SQLite's lock held past the busy timeout is an OperationalError too).
CONNECTION_ERRORS: tuple[type[exc.DBAPIError], ...] = (exc.OperationalError, exc.InterfaceError)


def is_unreachable(err: BaseException) -> bool:
    """True for a connection-level failure: the store is out, not the statement or the code wrong."""
    if isinstance(err, (StoreUnavailable, *CONNECTION_ERRORS)):
        return True
    # Any other DB-API error SQLAlchemy recognised as its connection dying (a "disconnect").
    return isinstance(err, exc.DBAPIError) and err.connection_invalidated


def only_dropped(err: BaseException) -> bool:
    """True when an open connection was found dead, rather than a new one refused or timed out.

    That is how every pooled connection from before a database restart fails
    once, in every process, after the database is back; the next attempt, on
    a fresh connection, says whether the store is really out.
    """
    cause: BaseException | None = err
    if isinstance(err, StoreUnavailable):
        cause = err.__cause__
    return isinstance(cause, exc.DBAPIError) and cause.connection_invalidated
