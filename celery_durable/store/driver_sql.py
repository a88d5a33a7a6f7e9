"""A run's hot statements as the driver's own SQL: compiled once per dialect, run with ``exec_driver_sql``.

``Connection.execute`` of a statement whose compiled form is cached still builds
its cache key, looks the form up and processes every bind through the compiled
statement on each call: ~15 µs of a run's every statement, five a new run. The
text and what the binds need do not change between calls, so they are worked
out once here. ``exec_driver_sql`` keeps what the store relies on: the driver's
errors raised as SQLAlchemy's (``IntegrityError``, ``OperationalError`` read as
an outage), a lost connection invalidated and its ``handle_error`` listeners
told, cursor events fired. Not ``before_execute``: a statement in a caller's
transaction, whose hooks must see it (``broker.in_transaction``), goes through
``Connection.execute`` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, CursorResult, Dialect
from sqlalchemy.sql.compiler import SQLCompiler


@dataclass(frozen=True)
class _Form:
    """The statement as one dialect's driver takes it."""

    sql: str
    names: tuple[str, ...] | None  # positional drivers: the binds in order (repeats included); else named
    static: dict[str, Any]  # binds the statement carries a value for (a call's own value wins)
    processors: tuple[tuple[str, Callable[[Any], Any]], ...]  # the binds whose type converts their value
    results: tuple[Callable[[Any], Any] | None, ...]  # per result column


class DriverStatement:
    """``statement`` run through ``exec_driver_sql``; ``columns``: its result columns, in order, if it has any.

    Built at import from a statement with no expanding binds (an IN list must
    be written into the text): the bound values a call gives are the only ones.
    """

    def __init__(self, statement: sa.ClauseElement, columns: Sequence[sa.ColumnElement[Any]] = ()) -> None:
        self.statement = statement
        self.columns = tuple(columns)
        self.keys = tuple(str(c.key) for c in self.columns)
        self._forms: dict[tuple[str, str], _Form] = {}

    def execute(self, conn: Connection, params: Mapping[str, Any]) -> CursorResult[Any]:
        dialect = conn.dialect
        form = self._forms.get((dialect.name, dialect.driver)) or self._compile(dialect)
        values = {**form.static, **params}
        for name, process in form.processors:
            values[name] = process(values[name])
        if form.names is None:
            return conn.exec_driver_sql(form.sql, values)
        return conn.exec_driver_sql(form.sql, tuple([values[name] for name in form.names]))

    def rows(self, conn: Connection, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Every result row as ``{column key: value}``, each value converted as its column's type reads it."""
        results = self._forms.get((conn.dialect.name, conn.dialect.driver)) or self._compile(conn.dialect)
        raw = self.execute(conn, params).all()
        return [{key: value if process is None else process(value)
                 for key, process, value in zip(self.keys, results.results, row)} for row in raw]

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
