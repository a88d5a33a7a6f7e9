"""Count files: how a worker's pool children hand their counts to the process that serves metrics.

A prefork child counts its runs in its own memory, which the parent's metrics
endpoint cannot read. So, while a worker shares a directory (made before the
pool forks and named to the children in an environment variable they
inherit), every process writes its whole count table to a file of its own
after each count (``celery_durable/shared_dir.py``); the parent sums the files
at scrape time. Files of children that died or were replaced stay until the
worker stops: a counter never goes backwards. prometheus_client's own
multiprocess mode is global to the process (it would change how the user's own
metrics are collected), hence this.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import struct
import uuid
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: The table durable run counts (``jobs_total``) are shared in; other tables name their own.
JOBS_TABLE = "counts"
_SUFFIX = ".json"

#: A count table: label values (one tuple length per table) to a count.
Counts = dict[tuple[str, ...], float]


def file_name(table: str = JOBS_TABLE) -> str:
    """A name no other process of this worker uses, a pid reused by a later child included."""
    return f"{table}-{os.getpid()}-{uuid.uuid4().hex[:8]}{_SUFFIX}"


# A count file is a fixed-size map shared between its one writer and any
# reader: MAGIC, the length of the JSON table, a sequence number, the table.
# The writer makes the sequence odd, writes the table, makes it even again (a
# seqlock): a count is then two memory stores, not a file written and renamed
# (which cost a pool child ~15 % of a 3-step durable run on SQLite). A reader
# copies the file and keeps the copy only if the sequence was even and had not
# moved once the copy was taken.
MAGIC = b"DCF1"
#: MAGIC, the table's length, the sequence (8-aligned: one store on 64-bit hosts).
_HEADER = struct.Struct("<4sIQ")
_LENGTH = struct.Struct("<I")
_SEQUENCE = struct.Struct("<Q")
_LENGTH_AT, _SEQUENCE_AT = 4, 8
_INITIAL_SIZE = 16 * 1024
_READ_ATTEMPTS = 50

#: Each file this process writes, by (directory, name) as strings: hashing a fresh Path per count cost more
#: than the write itself.
_maps: dict[tuple[str, str], tuple[mmap.mmap, int]] = {}
_last_read: dict[Path, bytes] = {}


def write(directory: Path, name: str, counts: Mapping[tuple[str, ...], float]) -> None:
    """Publish this process's whole table: a reader sees the old table or the new, never half."""
    _publish(directory, name, json.dumps([[*key, value] for key, value in counts.items()]).encode())


def row(key: tuple[str, ...], value: float) -> str:
    """One row of a table as JSON: its label values, then its count."""
    return json.dumps([*key, float(value)])


def row_head(key: tuple[str, ...]) -> str:
    """A row's JSON up to its count, for :func:`row_with`: a key's labels never change, its count does."""
    return json.dumps([*key, 0.0])[:-len("0.0]")]


def row_with(head: str, value: float) -> str:
    """:func:`row` of the key ``head`` was made from, without encoding its labels again."""
    value = float(value)
    if not math.isfinite(value):
        return row(tuple(json.loads(head + "0.0]")[:-1]), value)  # json's NaN/Infinity spellings
    return f"{head}{value!r}]"


def write_rows(directory: Path, name: str, rows: Collection[str]) -> None:
    """:func:`write` of rows already made by :func:`row`.

    A process keeps each row's JSON and remakes only those a count changed:
    a table of a few hundred per-task keys is written after every task, and
    encoding it whole each time cost ~0.7 ms a task.
    """
    _publish(directory, name, ("[" + ",".join(rows) + "]").encode())


def _publish(directory: Path, name: str, data: bytes) -> None:
    where = (str(directory), name)
    try:
        mapped = _maps.get(where)
        if mapped is None or _HEADER.size + len(data) > len(mapped[0]):
            _maps[where] = mapped = _create(directory / name, data, previous=mapped)
            return
        view, sequence = mapped
        # Odd while the table and its length change; even again only after
        # both are in place (the length is never written under an even number).
        _SEQUENCE.pack_into(view, _SEQUENCE_AT, sequence + 1)
        view[_HEADER.size:_HEADER.size + len(data)] = data
        _LENGTH.pack_into(view, _LENGTH_AT, len(data))
        _SEQUENCE.pack_into(view, _SEQUENCE_AT, sequence + 2)
        _maps[where] = (view, sequence + 2)
    except (OSError, ValueError):
        # The worker is shutting down (its directory is gone) or the disk is
        # full: the count is still in this process's memory; only the
        # endpoint's view of it lags.
        logger.debug("durable.metrics.count_file_unwritten dir=%s", directory, exc_info=True,
                     extra={"event": "durable.metrics.count_file_unwritten", "dir": str(directory)})


def _create(path: Path, data: bytes, previous: tuple[mmap.mmap, int] | None) -> tuple[mmap.mmap, int]:
    """A new map holding ``data``, put in place atomically (first write, or a table outgrowing its map)."""
    size = max(_INITIAL_SIZE, 2 * (_HEADER.size + len(data)))
    sequence = previous[1] + 2 if previous is not None else 2
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(_HEADER.pack(MAGIC, len(data), sequence) + data)
        f.truncate(size)
    os.replace(tmp, path)
    with open(path, "r+b") as f:
        view = mmap.mmap(f.fileno(), size)
    if previous is not None:
        previous[0].close()
    return view, sequence


def read_all(directory: Path, *, skip: str, table: str = JOBS_TABLE) -> Counts:
    """The sum of every process's file of ``table`` but ``skip`` (the reader's own, counted from its memory)."""
    total: Counts = {}
    for path in _files(directory, f"{table}-"):
        if path.name == skip:
            continue
        for row in _rows(path):
            key = tuple(row[:-1])
            total[key] = total.get(key, 0.0) + row[-1]
    return total


def _files(directory: Path, prefix: str) -> Iterator[Path]:
    try:
        yield from (p for p in directory.iterdir() if p.name.startswith(prefix) and p.name.endswith(_SUFFIX))
    except OSError:
        return


def _is_row(row: Any) -> bool:
    """Label values then a count: what :func:`write` puts in a table, and nothing else."""
    return (isinstance(row, list) and len(row) >= 2 and all(isinstance(v, str) for v in row[:-1])
            and isinstance(row[-1], (int, float)) and not isinstance(row[-1], bool))


def _rows(path: Path) -> list[Any]:
    table = _read_table(path)
    if table is None:
        return []
    try:
        rows = json.loads(table)
    except ValueError:
        logger.debug("durable.metrics.count_file_unreadable path=%s", path, exc_info=True,
                     extra={"event": "durable.metrics.count_file_unreadable", "path": str(path)})
        return []
    return [r for r in rows if _is_row(r)] if isinstance(rows, list) else []


def _read_table(path: Path) -> bytes | None:
    """The table of a count file, from a copy taken while no write was under way; None if not one."""
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            for _ in range(_READ_ATTEMPTS):
                # Unbuffered reads at offset 0: a buffered file would hand a
                # retry the same copy again.
                raw = os.pread(f.fileno(), size, 0)
                if len(raw) < _HEADER.size:
                    return None
                magic, length, sequence = _HEADER.unpack_from(raw)
                if magic != MAGIC:
                    return None
                if sequence % 2 == 0 and os.pread(f.fileno(), _HEADER.size, 0) == raw[:_HEADER.size]:
                    table = _last_read[path] = raw[_HEADER.size:_HEADER.size + length]
                    return table
    except OSError:
        logger.debug("durable.metrics.count_file_unreadable path=%s", path, exc_info=True,
                     extra={"event": "durable.metrics.count_file_unreadable", "path": str(path)})
        return None
    # A writer busy through every attempt: the table this reader saw last
    # (a counter must not drop for one scrape).
    logger.debug("durable.metrics.count_file_busy path=%s", path,
                 extra={"event": "durable.metrics.count_file_busy", "path": str(path)})
    return _last_read.get(path)
