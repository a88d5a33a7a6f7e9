"""This worker's fleet limits as declared to the store: written, renewed by each sweep, differences logged once."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from celery_durable.planning.limit_declarations import CONCURRENCY, KEY_LIMIT, TASK_SCOPE, TaskLimits
from celery_durable.store import limit_declarations as store

logger = logging.getLogger("celery_durable.limits")


def scope_limits(limits: Mapping[str, TaskLimits]) -> dict[tuple[str, str], int]:
    """The limit of each (task, kind) of scope ``limits`` declare."""
    out: dict[tuple[str, str], int] = {}
    for name, task_limits in limits.items():
        if task_limits.concurrency is not None:
            out[(name, "task")] = task_limits.concurrency
        if task_limits.key is not None:
            out[(name, "key")] = task_limits.key_limit
    return out


class Declarations:
    """One worker's declared limits (the lowest live one applies fleet-wide)."""

    def __init__(self, holder: str, limits: Mapping[str, TaskLimits], ttl: float) -> None:
        self.holder = holder
        self.ttl = ttl
        self.mine = scope_limits(limits)
        #: (task, kind) pairs whose differing declarations this worker has already logged.
        self._differ_logged: set[tuple[str, str]] = set()

    def declare(self, conn: Any, now: datetime) -> None:
        """Write this worker's limits to the store; log, once per task and option, any other worker
        declaring another value (a rolling deploy changing a limit)."""
        mine = self.mine
        declared = store.declare(conn, self.holder, mine, self.ttl, now)
        for pair, (lowest, highest) in declared.items():
            if lowest == highest or pair in self._differ_logged:
                continue
            self._differ_logged.add(pair)
            task, kind = pair
            other = highest if mine[pair] == lowest else lowest
            option = CONCURRENCY if kind == TASK_SCOPE else KEY_LIMIT
            logger.warning("durable.limit.declarations_differ task=%s option=%s this worker=%s another=%s: "
                           "the lowest, %s, applies across the fleet", task, option, mine[pair], other, lowest,
                           extra={"event": "durable.limit.declarations_differ", "task": task, "option": option,
                                  "declared": mine[pair], "other": other, "applied": lowest})
