"""The one outage tracker of a process: every part that talks to a durable store reports to it; it says what is logged.

A failing call is reported with ``failed(url, err, event)``, a call that went
through with ``available(url)``. A connection-level failure (see
``store.unreachable``) is an outage: its first one logs
``durable.store.unavailable`` at warning, naming the error; the first call that
goes through after it logs ``durable.store.available`` with how long it
lasted; every failing call in between is logged at debug under the caller's
event, with its traceback. Any other failure (a bad statement, a bug) is no
outage and is logged under the caller's event at ``level`` with its traceback.

An open connection found dead does not start an outage by itself: after a
database restart every pooled connection of every process fails once that
way, with the store already back. The next call, on a fresh connection, says.

Under prefork every pool child meets the outage on its own. While the worker
shares a directory with its children (see ``metrics.count_files``), a marker
file there makes the whole worker say it once: the process that creates the
marker logs the outage, the one that removes it logs the recovery. Without a
shared directory (a stock worker, a script) each process says it once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from typing import Any

from sqlalchemy import exc

from celery_durable.errors import StoreUnavailable
from celery_durable.shared_dir import shared_dir
from celery_durable.store.unreachable import is_unreachable, only_dropped
from celery_durable.store.urls import shown_url

logger = logging.getLogger("celery_durable.store")

#: url -> wall time of the first failure of the outage this process is in (declared or not yet).
_failing_since: dict[str, float] = {}
#: Stores this process declared (or found declared) out: their recovery is to be told.
_down: set[str] = set()
_lock = threading.Lock()


def failed(url: str, err: BaseException, event: str, *, level: int = logging.ERROR, then: str = "",
           **fields: Any) -> None:
    """A call to the store at ``url`` failed with ``err``.

    ``event`` names the call (``durable.lease.renew_failed``), ``then`` what
    happens next (``tried again at the next beat``), ``fields`` go to ``extra``.
    """
    shown = shown_url(url)
    extra = {"event": event, "store": shown, **fields}
    detail = "".join(f" {name}={value}" for name, value in fields.items())
    if not is_unreachable(err):
        # Not the store being away: a bug or a statement the database refuses, which no waiting mends.
        logger.log(level, "%s store=%s%s error=%s%s", event, shown, detail, describe(err), f": {then}" if then else "",
                   exc_info=err, extra=extra)
        return
    logger.debug("%s store=%s%s error=%s%s", event, shown, detail, describe(err), f": {then}" if then else "",
                 exc_info=err, extra=extra)
    with _lock:
        since = _failing_since.setdefault(url, time.time())
        if url in _down or only_dropped(err):
            return
        _down.add(url)
    if _first_to_mark(url, since):
        logger.warning("durable.store.unavailable store=%s error=%s: durable runs and limited tasks wait "
                       "(no retry spent) until it answers; each failing call is logged at debug",
                       shown, describe(err),
                       extra={"event": "durable.store.unavailable", "store": shown, "error": describe(err)})


def available(url: str) -> None:
    """A call to the store at ``url`` went through; logs the end of an outage this worker had reported."""
    if url not in _failing_since:  # the common case: no lock on the hot path
        return
    with _lock:
        since = _failing_since.pop(url, None)
        if since is None or url not in _down:
            return
        _down.discard(url)
    since = _unmark(url, since)
    if since is not None:
        lasted = max(0.0, time.time() - since)
        logger.warning("durable.store.available store=%s lasted=%.1fs: answering again", shown_url(url), lasted,
                       extra={"event": "durable.store.available", "store": shown_url(url), "lasted": lasted})


def describe(err: BaseException) -> str:
    """The error in one line: the driver's own message, without SQLAlchemy's statement and help link."""
    shown = err.__cause__ if isinstance(err, StoreUnavailable) and err.__cause__ is not None else err
    if isinstance(shown, exc.DBAPIError) and shown.orig is not None:
        shown = shown.orig
    lines = str(shown).strip().splitlines()
    return f"{type(shown).__name__}: {lines[0] if lines else ''}"


def _marker(url: str) -> str | None:
    directory = shared_dir()
    if directory is None:
        return None
    return str(directory / f"store-outage-{hashlib.sha1(url.encode()).hexdigest()[:16]}")


def _first_to_mark(url: str, since: float) -> bool:
    marker = _marker(url)
    if marker is None:
        return True
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    except OSError:  # the directory went away (shutdown): say it here rather than not at all
        return True
    try:
        os.write(fd, repr(since).encode())  # the process that tells the recovery says how long it lasted
    finally:
        os.close(fd)
    return True


def _unmark(url: str, since: float) -> float | None:
    """The outage's start if this process is the one to tell its end, else None."""
    marker = _marker(url)
    if marker is None:
        return since
    try:
        with open(marker) as file:
            written = file.read()
        os.unlink(marker)
    except FileNotFoundError:
        return None
    except OSError:
        return since
    try:
        return min(since, float(written))
    except ValueError:  # read between its creation and its write
        return since
