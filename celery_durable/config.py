"""DurableConfig: every ``durable_*`` setting, read once at worker boot and validated."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigInvalid

#: Slots a queue gets when ``durable_queue_concurrency`` does not name it.
DEFAULT_QUEUE_SLOTS = 8

EXECUTION_MODES = ("prefork", "threads")

#: Seconds a run lease lives past its last heartbeat, unless ``durable_lease_ttl`` says otherwise.
DEFAULT_LEASE_TTL = 30.0


@dataclass(frozen=True)
class DurableConfig:
    """The validated settings of one ``-P durable`` worker.

    Built by :func:`from_celery_conf` at boot; a direct construction with a
    broken invariant raises :class:`ConfigInvalid` naming the setting.
    """

    max_in_flight: int | None = None
    default_queue_slots: int = DEFAULT_QUEUE_SLOTS
    queue_slots: Mapping[str, int] = field(default_factory=dict)
    execution: str = "prefork"
    safety_interval: float = 1.0
    #: Most ETA/countdown runs held waiting (they hold no slot until due).
    max_scheduled: int = 1000
    restore_interval: float = 10.0
    drain_timeout: float = 30.0
    idle_poll_interval: float = 0.05
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    #: Run the outbox relay inside this worker.
    relay: bool = True
    relay_batch_size: int = 500
    #: Seconds between outbox polls when no notification comes (SQLite, or LISTEN lost).
    relay_poll_interval: float = 1.0
    #: Seconds a published outbox row is kept before the relay deletes it.
    outbox_retention: float = 86400.0
    #: Seconds a run's lease outlives its holder's last heartbeat (renewed every third of it):
    #: how long a run whose worker died waits before another delivery takes it over.
    lease_ttl: float = DEFAULT_LEASE_TTL

    def __post_init__(self) -> None:
        if self.max_in_flight is not None:
            whole_number("durable_max_in_flight", self.max_in_flight)
        whole_number("durable_queue_concurrency", self.default_queue_slots)
        if not isinstance(self.queue_slots, Mapping):
            raise ConfigInvalid(
                "durable_queue_concurrency",
                f"per-queue slots must be a mapping of queue name to slots, got {self.queue_slots!r}",
            )
        # Validate and keep a copy: the caller's dict must not be able to change
        # a frozen config behind its validation.
        object.__setattr__(self, "queue_slots", dict(self.queue_slots))
        for queue, slots in self.queue_slots.items():
            if not isinstance(queue, str) or not queue:
                raise ConfigInvalid(
                    "durable_queue_concurrency", f"keys must be queue names, got {queue!r}"
                )
            whole_number(f"durable_queue_concurrency[{queue!r}]", slots)
        if self.execution not in EXECUTION_MODES:
            raise ConfigInvalid(
                "durable_execution", f"must be one of {EXECUTION_MODES}, got {self.execution!r}"
            )
        positive_seconds("durable_safety_interval", self.safety_interval)
        whole_number("durable_max_scheduled", self.max_scheduled)
        positive_seconds("durable_restore_interval", self.restore_interval)
        positive_seconds("durable_drain_timeout", self.drain_timeout, allow_zero=True)
        positive_seconds("durable_idle_poll_interval", self.idle_poll_interval)
        if self.metrics_port is not None:
            whole_number("durable_metrics_port", self.metrics_port)
            if self.metrics_port > 65535:
                raise ConfigInvalid(
                    "durable_metrics_port", f"must be a port 1..65535, got {self.metrics_port!r}"
                )
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise ConfigInvalid(
                "durable_metrics_host", f"must be a host name or address, got {self.metrics_host!r}"
            )

        if not isinstance(self.relay, bool):
            # "false" as a string would be truthy: refuse it rather than run a relay nobody wanted.
            raise ConfigInvalid("durable_relay", f"must be True or False, got {self.relay!r}")
        whole_number("durable_relay_batch_size", self.relay_batch_size)
        positive_seconds("durable_relay_poll_interval", self.relay_poll_interval)
        positive_seconds("durable_outbox_retention", self.outbox_retention)
        positive_seconds("durable_lease_ttl", self.lease_ttl)

    def slots_for(self, queue: str) -> int:
        return self.queue_slots.get(queue, self.default_queue_slots)

    def check_queues(self, consumed: Iterable[str]) -> None:
        """Refuse slots named for a queue this worker does not consume (a typo, usually)."""
        consumed = set(consumed)
        unknown = sorted(set(self.queue_slots) - consumed)
        if unknown:
            raise ConfigInvalid(
                "durable_queue_concurrency",
                f"names queues this worker does not consume: {', '.join(unknown)} "
                f"(consumed: {', '.join(sorted(consumed))})",
            )


def whole_number(setting: str, value: Any) -> int:
    # bool is an int subclass: True would silently mean 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigInvalid(setting, f"must be a whole number >= 1, got {value!r}")
    if value < 1:
        raise ConfigInvalid(setting, f"must be a whole number >= 1, got {value!r}")
    return value


def positive_seconds(setting: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigInvalid(setting, f"must be a number of seconds, got {value!r}")
    if math.isnan(value) or math.isinf(value):
        raise ConfigInvalid(setting, f"must be a finite number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigInvalid(setting, f"must be {bound} seconds, got {value!r}")
    return float(value)


def from_celery_conf(conf: Mapping[str, Any]) -> DurableConfig:
    """Read and validate every ``durable_*`` setting of a Celery app's conf."""
    known = {
        "durable_max_in_flight",
        "durable_queue_concurrency",
        "durable_execution",
        "durable_safety_interval",
        "durable_max_scheduled",
        "durable_restore_interval",
        "durable_drain_timeout",
        "durable_idle_poll_interval",
        "durable_metrics_port",
        "durable_metrics_host",
        "durable_relay",
        "durable_relay_batch_size",
        "durable_relay_poll_interval",
        "durable_outbox_retention",
        "durable_lease_ttl",
        # Read by later parts of the package; accepted here so setting them
        # does not refuse a worker's boot.
        "durable_database_url",
    }
    unknown = sorted(
        key for key in conf if isinstance(key, str) and key.startswith("durable_") and key not in known
    )
    if unknown:
        raise ConfigInvalid(unknown[0], "is not a celery_durable setting (a typo?)")

    slots = conf.get("durable_queue_concurrency")
    default_slots, per_queue = DEFAULT_QUEUE_SLOTS, {}
    if isinstance(slots, Mapping):
        per_queue = dict(slots)
    elif slots is not None:
        default_slots = slots

    kwargs: dict[str, Any] = {
        "max_in_flight": conf.get("durable_max_in_flight"),
        "default_queue_slots": default_slots,
        "queue_slots": per_queue,
    }
    optional = {
        "durable_execution": "execution",
        "durable_safety_interval": "safety_interval",
        "durable_max_scheduled": "max_scheduled",
        "durable_restore_interval": "restore_interval",
        "durable_drain_timeout": "drain_timeout",
        "durable_idle_poll_interval": "idle_poll_interval",
        "durable_metrics_port": "metrics_port",
        "durable_metrics_host": "metrics_host",
        "durable_relay": "relay",
        "durable_relay_batch_size": "relay_batch_size",
        "durable_relay_poll_interval": "relay_poll_interval",
        "durable_outbox_retention": "outbox_retention",
        "durable_lease_ttl": "lease_ttl",
    }
    for setting, name in optional.items():
        value = conf.get(setting)
        if value is not None:
            kwargs[name] = value
    return DurableConfig(**kwargs)


def lease_ttl(conf: Mapping[str, Any]) -> float:
    """``durable_lease_ttl`` as a durable task reads it (also under a stock worker, which never
    builds a DurableConfig): validated the same way."""
    value = conf.get("durable_lease_ttl")
    return DEFAULT_LEASE_TTL if value is None else positive_seconds("durable_lease_ttl", value)
