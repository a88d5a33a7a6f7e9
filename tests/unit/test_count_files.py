"""jobs_total summed over a worker's processes: forked children write count files, the reader sums them."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from celery_durable import shared_dir
from celery_durable.metrics import count_files
from celery_durable.metrics import jobs as metrics

QUEUE = "count-files-q"


def _count_in_child(outcomes: list[str]) -> None:
    for outcome in outcomes:
        metrics.count(QUEUE, outcome)
    os._exit(0)


def _fork_and_count(*outcomes: str) -> None:
    child = multiprocessing.get_context("fork").Process(target=_count_in_child, args=(list(outcomes),))
    child.start()
    child.join(30)
    assert child.exitcode == 0


@pytest.fixture
def shared(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv(shared_dir.ENV_VAR, str(tmp_path))
    return tmp_path


def test_children_counts_reach_the_parent_and_outlive_the_children(shared: Path) -> None:
    before = metrics.value(QUEUE, "succeeded")
    _fork_and_count("succeeded", "succeeded", "duplicate")
    # A second child, as one replacing the first would be: the first's file stays.
    _fork_and_count("succeeded", "dead_lettered")
    assert metrics.value(QUEUE, "succeeded") == before + 3
    assert metrics.value(QUEUE, "dead_lettered") == 1
    assert len(list(shared.glob("counts-*.json"))) == 2


def test_a_forked_child_does_not_carry_its_parents_counts(shared: Path) -> None:
    metrics.count(QUEUE, "cancelled")
    parent_only = metrics.value(QUEUE, "cancelled")
    _fork_and_count("cancelled")
    # Parent's own (from memory and its file, counted once) plus the child's one.
    assert metrics.value(QUEUE, "cancelled") == parent_only + 1


def test_without_a_shared_directory_counts_stay_in_the_process(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.delenv(shared_dir.ENV_VAR, raising=False)
    before = metrics.value(QUEUE, "failed")
    _fork_and_count("failed")
    assert metrics.value(QUEUE, "failed") == before
    metrics.count(QUEUE, "failed")
    assert metrics.value(QUEUE, "failed") == before + 1


def test_a_torn_or_foreign_file_is_skipped_and_a_vanished_directory_is_not_an_error(shared: Path) -> None:
    (shared / "counts-1-bad.json").write_text("{not json")
    (shared / "counts-2-odd.json").write_text('[["q", "succeeded"]]')
    (shared / "unrelated.txt").write_text("[]")
    count_files.write(shared, "counts-3-ok.json", {(QUEUE, "succeeded"): 2.0})
    assert count_files.read_all(shared, skip="none") == {(QUEUE, "succeeded"): 2.0}
    gone = shared / "removed-at-shutdown"
    count_files.write(gone, "counts-4-late.json", {(QUEUE, "succeeded"): 1.0})
    assert count_files.read_all(gone, skip="none") == {}


def _count_fast_in_child(directory: str, rounds: int) -> None:
    counts: dict[tuple[str, str], float] = {}
    for i in range(rounds):
        # A table whose size changes as it grows: torn copies would not parse or would drop rows.
        counts[(f"{QUEUE}-{i % 40}", "succeeded")] = counts.get((f"{QUEUE}-{i % 40}", "succeeded"), 0.0) + 1
        count_files.write(Path(directory), "counts-busy-writer.json", counts)
    os._exit(0)


def test_a_reader_never_sees_a_half_written_table_or_a_count_going_back(shared: Path) -> None:
    child = multiprocessing.get_context("fork").Process(target=_count_fast_in_child, args=(str(shared), 20000))
    child.start()
    seen = []
    while child.is_alive():
        total = count_files.read_all(shared, skip="none")
        seen.append(sum(total.values()))
    child.join(30)
    assert child.exitcode == 0
    assert seen == sorted(seen), "a count went back between two reads"
    assert sum(count_files.read_all(shared, skip="none").values()) == 20000


def test_a_table_that_outgrows_its_file_is_still_read_whole(shared: Path) -> None:
    counts = {(f"queue-{i:05d}-{'x' * 40}", "succeeded"): float(i) for i in range(1000)}
    count_files.write(shared, "counts-big.json", {(QUEUE, "failed"): 1.0})
    count_files.write(shared, "counts-big.json", counts)  # ~70 KB: past the first file's 16 KB
    assert count_files.read_all(shared, skip="none") == counts


def test_a_table_counted_before_its_directory_was_shared_is_written_whole(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    from celery_durable.metrics.process_counts import ProcessCounts

    monkeypatch.delenv(shared_dir.ENV_VAR, raising=False)
    table = ProcessCounts("unit-late-share")
    table.add(("a", "early"))
    monkeypatch.setenv(shared_dir.ENV_VAR, str(tmp_path))
    table.add_all([(("b", "late"), 2.0), (("a", "early"), 1.0)])
    assert count_files.read_all(tmp_path, skip="none", table="unit-late-share") == {("a", "early"): 2.0,
                                                                                   ("b", "late"): 2.0}
    assert count_files.read_all(tmp_path, skip="none") == {}, "another table's files were read"


@pytest.mark.parametrize("value", [0.0, 1.0, 3.0, 0.1 + 0.2, 1e300, 12345678901234.5, float("inf"), float("nan")])
def test_a_row_made_from_its_head_is_the_row_json_would_make(value: float) -> None:
    # The labels' JSON is kept per key and only the count appended: it must read back as json.dumps wrote it.
    key = ("durable.quick", 'ho"st\\é', "q\n", "")
    assert count_files.row_with(count_files.row_head(key), value) == count_files.row(key, value)


def test_a_directory_renamed_in_the_environment_is_followed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # shared_dir keeps the Path it last made: a worker started by a task's process names a new directory.
    first, second = tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv(shared_dir.ENV_VAR, str(first))
    assert shared_dir.shared_dir() == first
    monkeypatch.setenv(shared_dir.ENV_VAR, str(second))
    assert shared_dir.shared_dir() == second
    monkeypatch.delenv(shared_dir.ENV_VAR)
    assert shared_dir.shared_dir() is None
