"""A driver error met on a DB-API cursor SQLAlchemy did not open, handled as SQLAlchemy handles its own.

``store/driver_sql.py`` runs a run's hot statements on the connection's DB-API
cursor (SQLAlchemy's execution context cost ~13 µs a statement). A driver error
there must still do what ``Connection.exec_driver_sql`` does with it, which the
store relies on: raised as SQLAlchemy's error (``IntegrityError``;
``OperationalError`` read as an outage), a disconnect invalidating the
connection and the pool's older ones, and the engine's ``handle_error``
listeners told (``store.engine._share_disconnects`` drops a sibling pool's idle
connections). SQLAlchemy does all of it in ``Connection._handle_dbapi_exception``
(SQLAlchemy 2.0, which pyproject pins; ``context=None`` is the path it takes for
an error met before an execution context exists). Pinned by
tests/compat/test_sqlalchemy_errors.py and tests/integration/test_driver_sql.py.
"""

from __future__ import annotations

from typing import Any, NoReturn

from sqlalchemy.engine import Connection


def raise_as_sqlalchemy(conn: Connection, err: BaseException, statement: str, parameters: Any,
                        cursor: Any) -> NoReturn:
    """Raise ``err`` (met running ``statement`` on ``conn``'s DB-API cursor) as ``conn.exec_driver_sql`` would."""
    conn._handle_dbapi_exception(err, statement, parameters, cursor, None)
