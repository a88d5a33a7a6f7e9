"""One process's count table, shared with the worker's other processes through its count file.

Each table (``jobs_total``'s, the per-task counts') is kept per process; while
its worker shares a count directory (``-P durable`` makes one before its pool
forks, see :mod:`celery_durable.metrics.count_files`) every add also writes
the table to this process's file there, and :meth:`ProcessCounts.totals` sums
the process's own table with every other process's file: what a scrape of the
worker's endpoint shows under prefork, threads and solo alike.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from celery_durable import shared_dir
from celery_durable.metrics import count_files


class ProcessCounts:
    """This process's counts of one table, and the name of the file it shares them in."""

    def __init__(self, table: str) -> None:
        self.table = table
        self.lock = threading.Lock()
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        # A forked child starts from zero: the parent's counts are the parent's
        # (it still reports them), and copying them would count them twice.
        self.counts: count_files.Counts = {}
        #: Each key's row as written to the file, remade only when its count changes.
        self.rows: dict[tuple[str, ...], str] = {}
        #: Each key's row up to its count (``count_files.row_head``): the labels are encoded once.
        self.heads: dict[tuple[str, ...], str] = {}
        self.file_name = count_files.file_name(self.table)

    def add(self, key: tuple[str, ...], amount: float = 1.0) -> None:
        self.add_all([(key, amount)])

    def add_all(self, amounts: Iterable[tuple[tuple[str, ...], float]]) -> None:
        """Several keys at once: one write of the file for all of them (a run's count and its runtime)."""
        with self.lock:
            directory = shared_dir.shared_dir()
            for key, amount in amounts:
                value = self.counts[key] = self.counts.get(key, 0.0) + amount
                if directory is not None:
                    self.rows[key] = count_files.row_with(self._head(key), value)
            if directory is not None:
                if len(self.rows) != len(self.counts):
                    # Keys counted before the directory was shared have no row yet.
                    self.rows = {key: count_files.row_with(self._head(key), value)
                                 for key, value in self.counts.items()}
                # Under the lock: two threads' writes land in the order they counted.
                count_files.write_rows(directory, self.file_name, self.rows.values())

    def _head(self, key: tuple[str, ...]) -> str:
        head = self.heads.get(key)
        if head is None:
            head = self.heads[key] = count_files.row_head(key)
        return head

    def totals(self) -> count_files.Counts:
        with self.lock:
            own = dict(self.counts)
            name = self.file_name
        directory = shared_dir.shared_dir()
        if directory is None:
            return own
        total = count_files.read_all(directory, skip=name, table=self.table)
        for key, value in own.items():
            total[key] = total.get(key, 0.0) + value
        return total
