"""The directory a worker's processes share: named to forked children, removed at stop, orphans cleared."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from celery_durable import shared_dir


def test_share_names_a_fresh_directory_and_unshare_removes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(shared_dir.ENV_VAR, raising=False)
    directory = shared_dir.share()
    try:
        assert directory.is_dir() and os.environ[shared_dir.ENV_VAR] == str(directory)
    finally:
        shared_dir.unshare(directory)
    assert not directory.exists() and shared_dir.ENV_VAR not in os.environ


def test_share_removes_the_directory_of_a_worker_that_was_killed(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.setattr(shared_dir.tempfile, "tempdir", str(tmp_path))
    child = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    child.start()
    child.join(30)
    orphan = tmp_path / f"celery-durable-counts-{child.pid}-abc"
    orphan.mkdir()
    live = tmp_path / f"celery-durable-counts-{os.getpid()}-def"
    live.mkdir()
    directory = shared_dir.share()
    try:
        assert not orphan.exists() and live.exists()
        assert directory.parent == tmp_path
    finally:
        shared_dir.unshare(directory)
