"""The directory one worker's processes share: made before the pool forks, named to its children, removed at stop.

The worker's processes hand each other what memory cannot (a prefork child's
run counts, ``metrics/count_files.py``; the store outage already told,
``store/outage.py``) through files in it. Its name is in an environment
variable the pool's children inherit at fork.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

#: Names the shared directory to the processes of one worker (children inherit it at fork).
ENV_VAR = "CELERY_DURABLE_COUNTS_DIR"


#: The last value of ENV_VAR read and its Path: every count a pool child takes asks for the
#: directory, and building a Path each time was a third of what a count cost.
_last: tuple[str, Path] | None = None


def shared_dir() -> Path | None:
    """The directory this process's worker shares, or None (a stock worker, a script: each process alone)."""
    global _last
    value = os.environ.get(ENV_VAR)
    if not value:
        return None
    last = _last
    if last is None or last[0] != value:
        _last = last = (value, Path(value))
    return last[1]


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
    """Remove the directory at worker shutdown (what is in it dies with the worker, as memory does)."""
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
