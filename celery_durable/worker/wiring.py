"""WorkerWiring: what boot learned about one worker and hands its consumer, in one record per worker.

Kept here, keyed weakly by Celery's WorkController, rather than as attributes
set on it (which Celery does not promise to leave alone). ``celeryd_init``
records the command line, ``worker_init`` the validated config and the fleet
limits; the consumer reads them back with :func:`wiring_for`.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from celery_durable.config import DurableConfig
from celery_durable.errors import ConfigInvalid
from celery_durable.planning.limit_declarations import TaskLimits


@dataclass(frozen=True)
class CommandLine:
    """What the worker was started with that Celery no longer tells by ``worker_init``."""

    #: -c (or worker_concurrency) was given: by worker_init a missing -c is already cpu_count().
    concurrency_given: bool = True
    #: --autoscale: Celery's Pool bootstep sets the worker's autoscale only after worker_init.
    autoscale: bool = False
    #: durable_* settings the worker's own options override (worker/cli_options.py).
    overrides: dict[str, Any] = field(default_factory=dict)
    #: An option that could not be read at all (``--queue-concurrency reports``).
    refused: ConfigInvalid | None = None


@dataclass(frozen=True)
class WorkerWiring:
    """One worker's wiring: its command line (``celeryd_init``), then its config and limits (``worker_init``)."""

    command_line: CommandLine = field(default_factory=CommandLine)
    #: The validated config; None until ``worker_init`` wired a ``-P durable`` worker.
    config: DurableConfig | None = None
    #: The fleet limits its tasks declare, read and checked at ``worker_init``.
    limits: Mapping[str, TaskLimits] = field(default_factory=dict)

    @property
    def durable_config(self) -> DurableConfig:
        """The config of a wired worker (the consumer is made only after ``worker_init`` wired it)."""
        if self.config is None:
            raise LookupError("this worker was not wired by -P durable's worker_init")
        return self.config


_wirings: weakref.WeakKeyDictionary[Any, WorkerWiring] = weakref.WeakKeyDictionary()


def wire(worker: Any, **fields: Any) -> WorkerWiring:
    """Record ``fields`` of ``worker``'s wiring (the rest kept as they were); returns the whole record."""
    wiring = replace(wiring_for(worker), **fields)
    _wirings[worker] = wiring
    return wiring


def wiring_for(worker: Any) -> WorkerWiring:
    """What boot recorded for ``worker`` (an empty record if nothing yet)."""
    return _wirings.get(worker, WorkerWiring())
