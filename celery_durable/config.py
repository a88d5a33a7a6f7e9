"""DurableConfig: every ``durable_*`` setting, read once at worker boot and validated."""

from __future__ import annotations

import ipaddress
import math
import re
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc

from celery_durable.errors import ConfigInvalid
from celery_durable.store.schema import SUPPORTED_BACKENDS
from celery_durable.store.urls import broker_database, shown_url

#: Slots a queue gets when ``durable_queue_concurrency`` does not name it.
DEFAULT_QUEUE_SLOTS = 8

EXECUTION_MODES = ("prefork", "threads")

#: Seconds a run lease lives past its last heartbeat, unless ``durable_lease_ttl`` says otherwise.
DEFAULT_LEASE_TTL = 30.0
#: ``durable_broker_vacuum_dead_rows``: dead row versions that make a claiming worker VACUUM the broker's table.
DEFAULT_VACUUM_DEAD_ROWS = 1_000
#: ``durable_metrics_task_names_limit``: task names the per-task metrics show before folding the rest into ``other``.
DEFAULT_TASK_NAMES_LIMIT = 100
#: Its ceiling: each name is ~8 series per queue, and a scrape past ~100k series is a scraper's problem.
MOST_TASK_NAMES = 10_000
#: ``durable_metrics_port``: one port, or the first and last of a range the worker takes the first free one of.
MetricsPort = int | tuple[int, int]

#: Field metadata: the setting a field is read from, when it is not ``durable_<field name>``.
_SETTING = "setting"
#: Field metadata: which part of its setting's value a field takes (None: the field keeps its default).
_READ = "read"


def _per_queue(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else None


def _every_queue(value: Any) -> Any:
    return None if isinstance(value, Mapping) else value


# ``durable_queue_concurrency`` is one setting for two fields: a mapping names
# per-queue slots, anything else is the slots of every queue it does not name.
_QUEUE_CONCURRENCY = "durable_queue_concurrency"


@dataclass(frozen=True)
class DurableConfig:
    """The validated settings of one ``-P durable`` worker.

    Built by :func:`from_celery_conf` at boot; a direct construction with a
    broken invariant raises :class:`ConfigInvalid` naming the setting.
    """

    max_in_flight: int | None = None
    default_queue_slots: int = field(default=DEFAULT_QUEUE_SLOTS,
                                     metadata={_SETTING: _QUEUE_CONCURRENCY, _READ: _every_queue})
    queue_slots: Mapping[str, int] = field(default_factory=dict,
                                           metadata={_SETTING: _QUEUE_CONCURRENCY, _READ: _per_queue})
    execution: str = "prefork"
    safety_interval: float = 1.0
    #: Most ETA/countdown runs held waiting (they hold no slot until due).
    max_scheduled: int = 1000
    restore_interval: float = 10.0
    drain_timeout: float = 30.0
    idle_poll_interval: float = 0.05
    metrics_port: MetricsPort | None = None
    metrics_host: str = "127.0.0.1"
    #: Task names the per-task metrics show as themselves; names seen past it are shown as ``other``.
    metrics_task_names_limit: int = DEFAULT_TASK_NAMES_LIMIT
    #: The durable store; None means the default SQLite file (see ``store.engine.DEFAULT_URL``).
    #: Out of the repr: a config logged whole must not log the database password.
    database_url: str | None = field(default=None, repr=False)
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
    #: Seconds a settled run (succeeded or cancelled) and its steps are kept; 0 keeps them forever.
    run_retention: float = 7 * 86400.0
    #: Durable beat (``celery beat -S celery_durable.Scheduler``): seconds the leader's lease
    #: outlives its last renewal — how long a standby waits for a leader that died.
    beat_lease_ttl: float = 10.0
    #: ``durable_catch_up: "all"``: the most missed ticks one catch-up sends.
    beat_max_catch_up: int = 100
    #: The beat's name in the store (one leader per name); None: the app's main module's name.
    beat_name: str | None = None
    #: ``celery durable dashboard``: the token its requeue and cancel buttons ask for; None: the page is
    #: read-only. Out of the repr, like the database URL.
    dashboard_token: str | None = field(default=None, repr=False)
    #: ``durable+postgresql://`` broker: dead row versions (claims and acks leave them) that make a claiming
    #: worker VACUUM the broker's table; 0 leaves them to autovacuum (``broker/vacuum.py``).
    broker_vacuum_dead_rows: int = DEFAULT_VACUUM_DEAD_ROWS

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
            object.__setattr__(self, "metrics_port", metrics_port(self.metrics_port))
        metrics_host(self.metrics_host)
        whole_number("durable_metrics_task_names_limit", self.metrics_task_names_limit, at_most=MOST_TASK_NAMES)
        if self.database_url is not None:
            object.__setattr__(self, "database_url", database_url(self.database_url))

        if not isinstance(self.relay, bool):
            # "false" as a string would be truthy: refuse it rather than run a relay nobody wanted.
            raise ConfigInvalid("durable_relay", f"must be True or False, got {self.relay!r}")
        # Bounded above: the batch is an SQL LIMIT (signed 64-bit in both stores) and the interval a
        # select()/wait timeout; past either, each relay pass was an OverflowError's traceback.
        whole_number("durable_relay_batch_size", self.relay_batch_size, at_most=LARGEST_LIMIT)
        positive_seconds("durable_relay_poll_interval", self.relay_poll_interval, at_most=LONGEST_POLL)
        positive_seconds("durable_outbox_retention", self.outbox_retention)
        positive_seconds("durable_lease_ttl", self.lease_ttl)
        positive_seconds("durable_run_retention", self.run_retention, allow_zero=True)
        positive_seconds("durable_beat_lease_ttl", self.beat_lease_ttl)
        whole_number("durable_beat_max_catch_up", self.beat_max_catch_up)
        whole_number("durable_broker_vacuum_dead_rows", self.broker_vacuum_dead_rows, allow_zero=True)
        if self.beat_name is not None and (not isinstance(self.beat_name, str) or not self.beat_name
                                           or len(self.beat_name) > 200):
            raise ConfigInvalid("durable_beat_name", f"must be a name of 1 to 200 characters, got {self.beat_name!r}")
        if self.dashboard_token is not None and (not isinstance(self.dashboard_token, str)
                                                 or len(self.dashboard_token.strip()) < 8
                                                 or self.dashboard_token != self.dashboard_token.strip()):
            # The value itself is never echoed: it is a secret, and a near miss of one still is.
            raise ConfigInvalid("durable_dashboard_token", "must be a string of at least 8 characters with no "
                                "spaces around it (or None for a read-only dashboard)")

    @property
    def metrics_ports(self) -> tuple[int, int] | None:
        """The first and last port the metrics server may bind (the same port twice for one port)."""
        port = self.metrics_port
        if port is None:
            return None
        return (port, port) if isinstance(port, int) else port

    def slots_for(self, queue: str) -> int:
        return self.queue_slots.get(queue, self.default_queue_slots)

    def unconsumed_queues(self, consumed: Iterable[str]) -> list[str]:
        """Queues ``durable_queue_concurrency`` names that this worker does not consume.

        One settings module usually serves several deployments with different
        ``-Q``: their slots are not an error, they wait for a queue that
        ``add_consumer`` may add.
        """
        return sorted(set(self.queue_slots) - set(consumed))


#: The largest count a store takes as a LIMIT (PostgreSQL's bigint and SQLite's INTEGER: signed 64-bit).
LARGEST_LIMIT = 2**63 - 1
#: The longest poll interval taken: an hour.
LONGEST_POLL = 3600.0


def whole_number(setting: str, value: Any, *, at_most: int | None = None, allow_zero: bool = False) -> int:
    least = 0 if allow_zero else 1
    # bool is an int subclass: True would silently mean 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigInvalid(setting, f"must be a whole number >= {least}, got {value!r}")
    if value < least:
        raise ConfigInvalid(setting, f"must be a whole number >= {least}, got {value!r}")
    if at_most is not None and value > at_most:
        raise ConfigInvalid(setting, f"must be a whole number <= {at_most}, got {value!r}")
    return value


def positive_seconds(setting: str, value: Any, *, allow_zero: bool = False, at_most: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigInvalid(setting, f"must be a number of seconds, got {value!r}")
    if math.isnan(value) or math.isinf(value):
        raise ConfigInvalid(setting, f"must be a finite number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigInvalid(setting, f"must be {bound} seconds, got {value!r}")
    if at_most is not None and value > at_most:
        raise ConfigInvalid(setting, f"must be <= {at_most:g} seconds, got {value!r}")
    return float(value)


_PORT_RANGE = re.compile(r"\s*(\d+)\s*-\s*(\d+)\s*")
_PORT_EXPECTED = 'must be a port 1..65535 or a range of them ("9100-9109" or (9100, 9109))'


def metrics_port(value: Any) -> MetricsPort:
    """One port, or a range as (first, last): two workers on one host each take a free port of it."""
    setting = "durable_metrics_port"
    if isinstance(value, str):
        # Only the range form: a lone "9100" is refused like any count written as a string.
        found = _PORT_RANGE.fullmatch(value)
        if found is None:
            raise ConfigInvalid(setting, f"{_PORT_EXPECTED}, got {value!r}")
        bounds: list[Any] = [int(found[1]), int(found[2])]
    elif isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ConfigInvalid(setting, f"{_PORT_EXPECTED}, got {value!r}")
        bounds = list(value)
    else:
        return _port(value, value)
    first, last = (_port(bound, value) for bound in bounds)
    if first > last:
        raise ConfigInvalid(setting, f"must be a range from the lower port to the higher, got {value!r}")
    return (first, last)


def _port(port: Any, value: Any) -> int:
    # bool is an int subclass: True would silently mean port 1.
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigInvalid("durable_metrics_port", f"{_PORT_EXPECTED}, got {value!r}")
    return port


_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?")


def metrics_host(value: Any) -> str:
    """A literal IP address or a host name; whether the name resolves is found when the server binds."""
    setting = "durable_metrics_host"
    if not isinstance(value, str) or not value.strip():
        raise ConfigInvalid(setting, f"must be an IP address or a host name, got {value!r}")
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if value.startswith("["):
        raise ConfigInvalid(setting, f"must be an IP address without brackets, got {value!r}")
    if _HOST_NAME.fullmatch(value) is None:
        raise ConfigInvalid(setting, f"must be an IP address or a host name, got {value!r}")
    try:
        packed = socket.inet_aton(value)
    except OSError:
        return value
    # inet_aton reads "0" as 0.0.0.0 and "127.1" as 127.0.0.1: "0" would quietly expose
    # the metrics on every interface. Make the address, and the exposure, explicit.
    address = socket.inet_ntoa(packed)
    raise ConfigInvalid(setting, f"must be written out in full, got {value!r} (shorthand for {address}): "
                                 f"write {address!r} if that is meant")


def database_url(value: Any) -> str:
    """A PostgreSQL or SQLite SQLAlchemy URL whose driver is installed; never echoed with its password."""
    setting = "durable_database_url"
    if isinstance(value, sa.engine.URL):
        value = value.render_as_string(hide_password=False)
    if not isinstance(value, str) or not value.strip():
        # An empty string usually is an unset environment variable: using the default
        # SQLite file instead would give each worker a store of its own.
        shown = repr(shown_url(value) if isinstance(value, str) else value)
        raise ConfigInvalid(setting, f"must be a PostgreSQL or SQLite URL (leave it unset for the default "
                                     f"SQLite file), got {shown}")
    try:
        parsed = sa.engine.make_url(value)
    except (exc.ArgumentError, ValueError):
        raise ConfigInvalid(setting, f"is not a database URL (e.g. postgresql+psycopg2://user@host/db or "
                                     f"sqlite:///durable.sqlite), got {shown_url(value)!r}") from None
    shown = repr(shown_url(parsed))
    backend = parsed.get_backend_name()
    if backend == "postgres":
        raise ConfigInvalid(setting, f"must name the dialect postgresql (SQLAlchemy has no 'postgres'), "
                                     f"got {shown}")
    if backend not in SUPPORTED_BACKENDS:
        raise ConfigInvalid(setting, f"must be a PostgreSQL or SQLite URL (the store's SQL is written for "
                                     f"those), got a {backend} URL: {shown}")
    try:
        dialect = parsed.get_dialect()
    except exc.NoSuchModuleError:
        raise ConfigInvalid(setting, f"names a driver SQLAlchemy does not have ({parsed.drivername}), "
                                     f"got {shown}") from None
    try:
        dialect.import_dbapi()
    except ImportError as err:
        # Found now, not by every run failing later: the worker would boot and drop them all.
        raise ConfigInvalid(setting, f"needs the {parsed.get_driver_name()} driver, which is not installed "
                                     f"({err}), got {shown}") from None
    return value


def setting_of(config_field: Field[Any]) -> str:
    """The ``durable_*`` setting a DurableConfig field is read from."""
    setting: str = config_field.metadata.get(_SETTING, f"durable_{config_field.name}")
    return setting


def _settings() -> dict[str, tuple[Field[Any], ...]]:
    by_setting: dict[str, tuple[Field[Any], ...]] = {}
    for config_field in fields(DurableConfig):
        setting = setting_of(config_field)
        by_setting[setting] = (*by_setting.get(setting, ()), config_field)
    return by_setting


#: Every ``durable_*`` setting, with the fields it is read into. Derived from DurableConfig,
#: so a new setting is declared once, as a field (plus its check in ``__post_init__``).
SETTINGS = _settings()


def from_celery_conf(conf: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> DurableConfig:
    """Read and validate every ``durable_*`` setting of a Celery app's conf.

    ``overrides`` (setting name to value, e.g. from the worker's command line)
    replace what the conf says, and are validated the same way.
    """
    unknown = sorted(key for key in conf if _unknown_setting(key, getattr(conf, "prefix", None)))
    if unknown:
        raise ConfigInvalid(unknown[0], "is not a celery_durable setting (a typo?)")

    kwargs: dict[str, Any] = {}
    for setting, config_fields in SETTINGS.items():
        raw = overrides[setting] if overrides and setting in overrides else conf.get(setting)
        if raw is None:
            continue  # unset: the field's default
        for config_field in config_fields:
            read: Callable[[Any], Any] | None = config_field.metadata.get(_READ)
            value = raw if read is None else read(raw)
            if value is not None:
                kwargs[config_field.name] = value
    if "database_url" not in kwargs:
        # A ``durable+<url>`` broker: one database is broker and store, unless the app says otherwise.
        from_broker = broker_database(conf.get("broker_url"))
        if from_broker is not None:
            kwargs["database_url"] = from_broker
    return DurableConfig(**kwargs)


def _unknown_setting(key: Any, prefix: str | None) -> bool:
    """A key that looks like a ``durable_*`` setting but is none, as the conf holds it.

    Under a namespace (``config_from_object("django.conf:settings",
    namespace="CELERY")``) Celery reads ``durable_max_in_flight`` from
    ``CELERY_DURABLE_MAX_IN_FLIGHT`` (its ``ConfigurationView.prefix``, matched
    in the prefix's case), so a typo there is as much ours as one without it.
    """
    if not isinstance(key, str):
        return False
    if prefix and key.upper().startswith(prefix.upper()) and key[len(prefix):].lower().startswith("durable_"):
        name = key[len(prefix):]
        # Celery looks the setting up in the prefix's case only.
        spelled = name.upper() if prefix.isupper() else name.lower()
        return name != spelled or name.lower() not in SETTINGS
    return key.startswith("durable_") and key not in SETTINGS


def lease_ttl(conf: Mapping[str, Any]) -> float:
    """``durable_lease_ttl`` as a durable task reads it (also under a stock worker, which never
    builds a DurableConfig): validated the same way."""
    value = conf.get("durable_lease_ttl")
    return DEFAULT_LEASE_TTL if value is None else positive_seconds("durable_lease_ttl", value)
