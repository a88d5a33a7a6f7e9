"""The ``-P durable`` worker's command-line options, added the Celery way and read as setting overrides.

``celery -A proj worker -P durable --max-in-flight 4 --queue-concurrency reports=2,emails=4``:
Celery's extra-config parser (``-- durable.max_in_flight=4``) knows no ``durable``
namespace, so the options are ``app.user_options["worker"]`` entries (added by
``celery_durable.install(app)``). Celery passes their values to the worker as
keyword arguments, which ``celeryd_init`` hands us; here they are parsed into
the settings they override, which the worker validates like the settings
themselves, naming the option when one is refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery_durable.errors import ConfigInvalid


@dataclass(frozen=True)
class WorkerOption:
    flag: str
    setting: str
    help: str
    #: The option's text read as the type its setting takes.
    read: Callable[[str], Any]

    @property
    def keyword(self) -> str:
        """The name click gives the value (``--max-in-flight`` -> ``max_in_flight``)."""
        return self.flag.lstrip("-").replace("-", "_")


def add_worker_options(app: Any) -> None:
    """Add the options to ``celery worker`` for ``app`` (once, however often install runs)."""
    from celery.bin.base import CeleryOption

    options = app.user_options["worker"]
    present = {flag for option in options for flag in getattr(option, "opts", ())}
    for option in OPTIONS:
        if option.flag not in present:
            options.add(CeleryOption((option.flag,), help=f"{option.help} (overrides {option.setting})",
                                     help_group="Durable Options"))


def overrides(given: Mapping[str, Any]) -> dict[str, Any]:
    """The settings the worker's options override: setting name to value, read from the option's text.

    Only options given (not None) are there. A value is turned into the type
    its setting takes when it reads as one; otherwise it is kept as written,
    and the setting's own check refuses it, naming it.
    """
    found: dict[str, Any] = {}
    for option in OPTIONS:
        value = given.get(option.keyword)
        if value is not None:
            found[option.setting] = option.read(value) if isinstance(value, str) else value
    return found


def naming_the_option(err: ConfigInvalid, overridden: Mapping[str, Any],
                      flags: Mapping[str, str] | None = None) -> ConfigInvalid:
    """``err`` about a setting the command line gave: the same refusal, naming the option instead.

    ``overridden`` holds the settings the command line gave; ``flags`` names
    each setting's option (default: the worker's).
    """
    setting = err.setting or ""
    for name, flag in (WORKER_FLAGS if flags is None else flags).items():
        if name in overridden and setting.startswith(name):
            return ConfigInvalid(flag + setting[len(name):], err.problem)
    return err


_INTEGER = re.compile(r"[+-]?\d+")
_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_QUEUE_SLOT = re.compile(r"\s*([^=,\s][^=,]*?)\s*=\s*([^=,]*?)\s*")


def _number(text: str) -> Any:
    if _INTEGER.fullmatch(text.strip()):
        return int(text)
    if _DECIMAL.fullmatch(text.strip()):
        return float(text)
    return text


def _queue_slots(text: str) -> Any:
    """``"4"`` -> 4 (every queue); ``"reports=2,emails=4"`` -> {"reports": 2, "emails": 4}."""
    refused = ConfigInvalid("durable_queue_concurrency", f"must be N (every queue) or queue=N,queue=N, got {text!r}")
    if "=" not in text:
        every_queue = _number(text)
        if isinstance(every_queue, str):
            raise refused
        return every_queue
    slots: dict[str, Any] = {}
    for part in text.split(","):
        pair = _QUEUE_SLOT.fullmatch(part)
        if pair is None:
            raise refused
        slots[pair[1]] = _number(pair[2])
    return slots


OPTIONS = (
    WorkerOption("--max-in-flight", "durable_max_in_flight", "most runs this worker holds at once", _number),
    WorkerOption("--queue-concurrency", "durable_queue_concurrency",
                 "slots per queue: N for every queue, or reports=2,emails=4", _queue_slots),
    WorkerOption("--drain-timeout", "durable_drain_timeout",
                 "seconds a warm shutdown lets runs finish before handing them back", _number),
    WorkerOption("--metrics-port", "durable_metrics_port",
                 "port of the Prometheus endpoint, or a range (9100-9109) to take a free one of", _number),
)
#: Each setting a worker option overrides, and the option.
WORKER_FLAGS = {option.setting: option.flag for option in OPTIONS}
