"""A run's hot statements as the driver's own SQL: compiled once per dialect, run on the DB-API cursor.

``Connection.execute`` of a statement whose compiled form is cached still builds
its cache key, looks the form up and processes every bind through the compiled
statement on each call: ~15 µs of a run's every statement, five a new run. The
text and what the binds need do not change between calls, so they are worked
out once here. ``exec_driver_sql`` then still built an execution context, a
result and (for a RETURNING) its column metadata per call: ~30 µs a statement
more, about a third of a SQLite run's time in the store. So on an autocommit
connection nobody listens to (no ``before_cursor_execute``/``after_cursor_execute``)
the statement goes to the connection's DB-API cursor itself, and a driver error
is handed to SQLAlchemy's own handler (``compat.sqlalchemy_errors``): raised as SQLAlchemy raises it
(``IntegrityError``; ``OperationalError`` read as an outage), a lost connection
invalidated and its ``handle_error`` listeners told. A connection with cursor
listeners (tests and benchmarks counting statements) or in a transaction of its
own (SQLAlchemy must begin it) goes through ``exec_driver_sql`` as before. Not
``before_execute``: a statement in a caller's transaction, whose hooks must see it
(``broker.in_transaction``), goes through ``Connection.execute`` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.sql.compiler import SQLCompiler

from celery_durable.compat.sqlalchemy_errors import raise_as_sqlalchemy


@dataclass(frozen=True)
class _Form:
    """The statement as one dialect's driver takes it."""

    sql: str
    names: tuple[str, ...] | None  # positional drivers: the binds in order (repeats included); else named
    static: dict[str, Any]  # binds the statement carries a value for (a call's own value wins)
    processors: tuple[tuple[str, Callable[[Any], Any]], ...]  # the binds whose type converts their value
    results: tuple[Callable[[Any], Any] | None, ...]  # per result column


#: The execution option an engine whose every connection is in autocommit from the start carries
#: (``store.engine.autocommit``): its statements may go to the DB-API cursor with no SQLAlchemy
#: transaction to begin. Set by the one who made the engine, as the driver's own flag cannot tell
#: (the store's SQLite connections are all in driver autocommit; SQLAlchemy begins their transactions).
AUTOCOMMIT_OPTION = "durable_autocommit"


def in_autocommit(conn: Connection) -> bool:
    """Whether each statement on ``conn`` is its own transaction (an engine made in autocommit)."""
    options = conn.get_execution_options()
    return bool(options.get(AUTOCOMMIT_OPTION) or options.get("isolation_level") == "AUTOCOMMIT")


def on_cursor(conn: Connection) -> bool:
    """Whether a statement on ``conn`` may skip SQLAlchemy's execution: autocommit, and no cursor listeners."""
    if not in_autocommit(conn):
        return False
    dispatch = conn.dispatch
    return not (dispatch.before_cursor_execute or dispatch.after_cursor_execute)


class DriverStatement:
    """``statement`` run as driver SQL; ``columns``: its result columns, in order, if it has any.

    Built at import from a statement with no expanding binds (an IN list must
    be written into the text): the bound values a call gives are the only ones.
    """

    def __init__(self, statement: sa.ClauseElement, columns: Sequence[sa.ColumnElement[Any]] = ()) -> None:
        self.statement = statement
        self.columns = tuple(columns)
        self.keys = tuple(str(c.key) for c in self.columns)
        self._forms: dict[tuple[str, str], _Form] = {}

    def execute(self, conn: Connection, params: Mapping[str, Any]) -> int:
        """Run the statement; the number of rows it wrote (the driver's rowcount)."""
        return self._run(conn, self._form(conn.dialect), params, fetch=False)[1]

    def rows(self, conn: Connection, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Every result row as ``{column key: value}``, each value converted as its column's type reads it."""
        form = self._form(conn.dialect)
        raw = self._run(conn, form, params, fetch=True)[0]
        keys = self.keys
        return [{key: value if process is None else process(value)
                 for key, process, value in zip(keys, form.results, row)} for row in raw]

    def _run(self, conn: Connection, form: _Form, params: Mapping[str, Any], *,
             fetch: bool) -> tuple[Sequence[Any], int]:
        values = {**form.static, **params}
        for name, process in form.processors:
            values[name] = process(values[name])
        bound: Any = values if form.names is None else tuple([values[name] for name in form.names])
        if not on_cursor(conn):
            result = conn.exec_driver_sql(form.sql, bound)
            return (result.all() if fetch else []), result.rowcount
        cursor = None
        try:
            cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]  # conn.connection checked it
            try:
                cursor.execute(form.sql, bound)
                return (cursor.fetchall() if fetch else []), cursor.rowcount
            finally:
                cursor.close()
        except BaseException as err:
            if isinstance(err, Exception) and not isinstance(err, conn.dialect.loaded_dbapi.Error):
                raise  # not the driver's: raised as it is, as SQLAlchemy's execution would
            # SQLAlchemy's own handling of a driver error (and of an interrupt mid-statement): wrapped,
            # a disconnect invalidates the connection (and the pool's older ones), handle_error told.
            raise_as_sqlalchemy(conn, err, form.sql, bound, cursor)

    def _form(self, dialect: Dialect) -> _Form:
        return self._forms.get((dialect.name, dialect.driver)) or self._compile(dialect)

    def _compile(self, dialect: Dialect) -> _Form:
        compiled = self.statement.compile(dialect=dialect)
        if not isinstance(compiled, SQLCompiler) or compiled.post_compile_params \
                or compiled.literal_execute_params or compiled.escaped_bind_names:
            raise ValueError(f"not a statement for exec_driver_sql (DDL, expanding or escaped binds): {compiled}")
        binds = compiled.bind_names.items()  # each bind and its name in the text
        processors = {name: bind.type.dialect_impl(dialect).bind_processor(dialect) for bind, name in binds}
        form = _Form(
            sql=compiled.string,
            names=tuple(compiled.positiontup or ()) if dialect.positional else None,
            static={name: bind.value for bind, name in binds if not bind.required},
            processors=tuple((name, process) for name, process in processors.items() if process is not None),
            results=tuple(c.type.dialect_impl(dialect).result_processor(dialect, None) for c in self.columns),
        )
        self._forms[(dialect.name, dialect.driver)] = form
        return form
