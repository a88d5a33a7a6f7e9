"""Count files: how a worker's pool children hand their run counts to the process that serves metrics.

A prefork child counts its runs in its own memory, which the parent's metrics
endpoint cannot read. So, while a worker shares a directory (made before the
pool forks and named to the children in an environment variable they
inherit), every process writes its whole count table to a file of its own
after each count; the parent sums the files at scrape time. Files of children
that died or were replaced stay until the worker stops: a counter never goes
backwards. prometheus_client's own multiprocess mode is global to the process
(it would change how the user's own metrics are collected), hence this.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Names the shared directory to the processes of one worker (children inherit it at fork).
ENV_VAR = "CELERY_DURABLE_COUNTS_DIR"

_PREFIX = "counts-"
_SUFFIX = ".json"

Counts = dict[tuple[str, str], float]


def shared_dir() -> Path | None:
    """The directory this process's worker shares counts in, or None (counts stay in memory)."""
    value = os.environ.get(ENV_VAR)
    return Path(value) if value else None


#: A shared directory's name starts with this and the pid of the worker that made it.
_DIR_PREFIX = "celery-durable-counts-"


def share() -> Path:
    """Make a fresh directory and name it to every process forked from now on; returns it."""
    _remove_orphans()
    directory = Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-"))
    # An inherited value (a worker started by another worker's task) is replaced:
    # each worker sums only its own processes.
    os.environ[ENV_VAR] = str(directory)
    return directory


def unshare(directory: Path) -> None:
    """Remove the directory at worker shutdown (its counts die with the worker, as in-memory ones do)."""
    if os.environ.get(ENV_VAR) == str(directory):
        del os.environ[ENV_VAR]
    shutil.rmtree(directory, ignore_errors=True)


def _remove_orphans() -> None:
    # A worker killed with SIGKILL (or the OOM killer) never removes its
    # directory: the next worker on the host does, once that pid is gone.
    for path in Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*"):
        owner = path.name[len(_DIR_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def file_name() -> str:
    """A name no other process of this worker uses, a pid reused by a later child included."""
    return f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}{_SUFFIX}"


def write(directory: Path, name: str, counts: Mapping[tuple[str, str], float]) -> None:
    """Replace this process's file atomically: a scrape reads the old table or the new, never half."""
    rows = [[queue, outcome, value] for (queue, outcome), value in counts.items()]
    tmp = directory / f".{name}.tmp"
    try:
        tmp.write_text(json.dumps(rows))
        os.replace(tmp, directory / name)
    except OSError:
        # The worker is shutting down (its directory is gone) or the disk is
        # full: the count is still in this process's memory; only the
        # endpoint's view of it lags.
        logger.debug("durable.metrics.count_file_unwritten dir=%s", directory, exc_info=True)


def read_all(directory: Path, *, skip: str) -> Counts:
    """The sum of every process's file but ``skip`` (the reader's own, counted from its memory)."""
    total: Counts = {}
    for path in _files(directory):
        if path.name == skip:
            continue
        for queue, outcome, value in _rows(path):
            total[(queue, outcome)] = total.get((queue, outcome), 0.0) + value
    return total


def _files(directory: Path) -> Iterator[Path]:
    try:
        yield from (p for p in directory.iterdir() if p.name.startswith(_PREFIX) and p.name.endswith(_SUFFIX))
    except OSError:
        return


def _rows(path: Path) -> list[Any]:
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        # Only os.replace() puts a file here, so a bad one is not ours half-written: skip it.
        logger.debug("durable.metrics.count_file_unreadable path=%s", path, exc_info=True)
        return []
    return [r for r in rows if isinstance(r, list) and len(r) == 3]
