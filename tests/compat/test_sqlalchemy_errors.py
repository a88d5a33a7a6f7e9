"""compat.sqlalchemy_errors: a driver error raised through SQLAlchemy's own handling, as exec_driver_sql raises it."""

from __future__ import annotations

import inspect
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_durable.compat.sqlalchemy_errors import raise_as_sqlalchemy


def test_the_handler_takes_what_it_is_handed():
    # The touch point: Connection._handle_dbapi_exception(e, statement, parameters, cursor, context).
    params = list(inspect.signature(Connection._handle_dbapi_exception).parameters)
    assert params[:6] == ["self", "e", "statement", "parameters", "cursor", "context"]


def _driver_error(conn: Connection, sql: str) -> tuple[BaseException, sqlite3.Cursor]:
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.execute(sql)
    except sqlite3.Error as err:
        return err, cursor
    raise AssertionError(f"{sql} did not fail")


@pytest.mark.parametrize("sql", ["INSERT INTO t VALUES (1)", "SELEC nothing"])
def test_a_driver_error_is_raised_as_exec_driver_sql_raises_it(tmp_path: Path, sql: str):
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'c.sqlite'}", isolation_level="AUTOCOMMIT")
    told: list[bool] = []
    sa.event.listen(engine, "handle_error", lambda context: told.append(context.is_disconnect))
    with engine.connect() as conn:
        conn.exec_driver_sql("CREATE TABLE t (id INTEGER PRIMARY KEY)")
        conn.exec_driver_sql("INSERT INTO t VALUES (1)")
        with pytest.raises(sa.exc.DBAPIError) as expected:
            conn.exec_driver_sql(sql)
        err, cursor = _driver_error(conn, sql)
        with pytest.raises(sa.exc.DBAPIError) as raised:
            raise_as_sqlalchemy(conn, err, sql, (), cursor)
        assert type(raised.value) is type(expected.value)
        assert raised.value.orig is err and raised.value.__cause__ is err
        assert (raised.value.statement, raised.value.connection_invalidated) == (sql, False)
        assert told == [False, False]  # the engine's handle_error listeners, told each time
        assert conn.exec_driver_sql("SELECT count(*) FROM t").scalar_one() == 1  # still usable
