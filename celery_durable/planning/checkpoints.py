"""Pure step bookkeeping: step keys by call order, name checks and the JSON round-trip rule."""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any

from kombu.utils import json as kombu_json

from celery_durable.errors import NotJSON, RunIdInvalid, StepNameInvalid

#: Longest step name the steps table holds (``durable_steps.name`` is VARCHAR(200)).
MAX_STEP_NAME = 200

#: Longest run id the runs table holds (``durable_runs.id`` is VARCHAR(255)).
MAX_RUN_ID = 255

#: How much of a refused value an error message shows.
SHOWN = 40


@dataclass(frozen=True, order=True)
class StepKey:
    """A step's identity in its run: the name and how many times that name was called before."""

    name: str
    occurrence: int


def shown(value: Any) -> str:
    """``value`` for an error message: its repr, cut short.

    A repr escapes a NUL and a lone surrogate, so the message itself can be
    logged and stored as a run's last error.
    """
    if isinstance(value, str):
        return repr(value[:SHOWN]) + ("..." if len(value) > SHOWN else "")
    text = repr(value)
    return text[:SHOWN] + ("..." if len(text) > SHOWN else "")


def unstorable(value: str, limit: int) -> str | None:
    """Why a VARCHAR(``limit``) column of PostgreSQL or SQLite cannot hold ``value``; None if it can."""
    if "\x00" in value:
        # PostgreSQL text cannot hold NUL: psycopg2 refuses the statement.
        return f"contains a NUL character (\\x00) at position {value.index(chr(0))}"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"is not encodable as UTF-8: a lone surrogate {value[err.start]!r} at position {err.start}"
    # PostgreSQL counts VARCHAR(n) in characters (SQLite does not enforce it):
    # a name of 67 "€" fits the column, so no byte limit refuses it.
    if len(value) > limit:
        return f"is {len(value)} characters; at most {limit}"
    return None


def check_step_name(name: Any) -> str:
    """``name`` if the steps table can hold it; checked before the step's fn runs, so a bad name never runs it."""
    if not isinstance(name, str) or not name.strip():
        raise StepNameInvalid(f"a step name must be a non-empty string, got {shown(name)}")
    problem = unstorable(name, MAX_STEP_NAME)
    if problem is not None:
        raise StepNameInvalid(f"step name {shown(name)} {problem}")
    return name


def check_run_id(value: Any) -> str:
    """``value`` if the runs table can hold it as a run's id (a Celery task id is whatever the sender chose)."""
    if not isinstance(value, str) or not value:
        raise RunIdInvalid(f"a run id (the Celery task id) must be a non-empty string, got {shown(value)}")
    problem = unstorable(value, MAX_RUN_ID)
    if problem is not None:
        raise RunIdInvalid(f"run id (the Celery task id) {shown(value)} {problem}")
    return value


@dataclass
class Ledger:
    """The checkpoints a run had when it started, and the occurrence each name is at now.

    Keys are handed out by call order: the n-th call of a name in an execution is
    occurrence n, so a replay in the same order finds the same checkpoints.
    """

    stored: dict[StepKey, str] = field(default_factory=dict)
    _next: dict[str, int] = field(default_factory=dict)

    def next_key(self, name: Any) -> StepKey:
        name = check_step_name(name)
        occurrence = self._next.get(name, 0)
        self._next[name] = occurrence + 1
        return StepKey(name, occurrence)

    def lookup(self, key: StepKey) -> str | None:
        """The stored JSON of ``key``, or None when the step has not completed."""
        return self.stored.get(key)

    def record(self, key: StepKey, encoded: str) -> None:
        self.stored[key] = encoded


#: What kombu's JSON carries beside plain JSON, as ``{"__type__": ..., "__value__": ...}``
#: (kombu ``utils/json.py``): Celery's json serializer sends task arguments of these
#: types, so a durable run stores them, and a step may return them, the same way.
KOMBU_TYPED = (datetime, date, time, Decimal, uuid.UUID, bytes)


def _same(a: Any, b: Any) -> bool:
    # == alone passes 1 == 1.0 == True and misses a tuple turned into a list;
    # the types must survive too, or a replay would hand back something else.
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _first_offender(value: Any, path: str = "") -> str:
    """Where in ``value`` JSON loses something, for the error message."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"key {k!r} at {path or 'top level'} is a {type(k).__name__}, not a str"
            found = _first_offender(v, f"{path}[{k!r}]")
            if found:
                return found
        return "" if isinstance(value, dict) else f"{path or 'the value'} is a {type(value).__name__}, not a dict"
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = _first_offender(v, f"{path}[{i}]")
            if found:
                return found
        return ""
    if value is None or isinstance(value, (str, bool, int, *KOMBU_TYPED)):
        return ""
    if isinstance(value, float):
        return "" if math.isfinite(value) else f"{path or 'the value'} is {value!r}, which JSON cannot hold"
    return f"{path or 'the value'} is a {type(value).__name__}"


def to_json(what: str, value: Any) -> str:
    """Encode ``value``, refusing anything a decode would not give back as it was.

    ``what`` names the value in the error (e.g. ``step 'charge'``).
    """
    try:
        encoded = _dumps(value)
    except (TypeError, ValueError) as err:
        detail = _first_offender(value) or str(err)
        raise NotJSON(f"{what} must be JSON (str, int, float, bool, None, list, dict with str keys, or "
                      f"what Celery's JSON carries: datetime, date, time, Decimal, UUID, bytes): "
                      f"{detail}") from None
    try:
        decoded = from_json(encoded)
    except ValueError:
        decoded = _UNDECODABLE  # a dict that looks like kombu's typed envelope but is not one
    if not _same(value, decoded):
        detail = _first_offender(value) or "it does not decode to an equal value"
        raise NotJSON(f"{what} does not round-trip through JSON: {detail} "
                      f"(return lists and dicts with str keys)")
    return encoded


_UNDECODABLE = object()


def _dumps(value: Any) -> str:
    encoded: str = kombu_json.dumps(value, allow_nan=False, separators=(",", ":"))
    return encoded


def from_json(encoded: str | None) -> Any:
    """A stored value as it was encoded (kombu's typed values decoded back: a datetime is a datetime)."""
    return None if encoded is None else kombu_json.loads(encoded)


def encode(what: str, value: Any) -> str:
    """Encode a run's arguments or result: JSON-serialisable is enough (a tuple is kept as a list).

    Unlike a step's result, nothing is handed back to the body from these, so a
    tuple coming back as a list changes nothing a replay depends on.
    """
    try:
        return _dumps(value)
    except (TypeError, ValueError) as err:
        detail = _first_offender(value) or str(err)
        raise NotJSON(f"{what} must be JSON-serialisable to be stored: {detail}") from None
