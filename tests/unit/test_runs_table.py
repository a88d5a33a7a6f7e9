"""``celery durable runs list``'s table: a header row over the runs, each column under its title."""

from __future__ import annotations

from celery_durable.cli.runs import runs_table


def _row(**overrides: object) -> dict[str, object]:
    row: dict[str, object] = {"id": "6f1c0d9e-0000-4000-8000-000000000001", "state": "dead", "task": "proj.fulfil",
                              "attempts": 3, "updated_at": "2026-12-06T20:00:00+00:00",
                              "last_error": "RuntimeError('carrier rejected the parcel')\nTraceback ..."}
    row.update(overrides)
    return row


def test_a_header_row_names_each_column_over_its_values() -> None:
    header, line = runs_table([_row()])
    assert header.split()[:5] == ["ID", "STATE", "TASK", "ATTEMPTS", "UPDATED"] and header.endswith("LAST ERROR")
    for title, value in (("ID", "6f1c0d9e"), ("STATE", "dead"), ("TASK", "proj.fulfil"), ("UPDATED", "2026-12-06")):
        assert header.index(title) == line.index(value), title
    assert header.index("ATTEMPTS") + len("ATTEMPTS") == line.index(" 3 ") + 2  # numbers right-aligned
    assert header.index("LAST ERROR") == line.index("RuntimeError")
    assert "Traceback" not in line  # the error's first line only


def test_no_runs_no_table_and_a_run_without_error_ends_at_its_time() -> None:
    assert runs_table([]) == []
    _, line = runs_table([_row(last_error=None, state="succeeded")])
    assert line.endswith("2026-12-06T20:00:00+00:00")
