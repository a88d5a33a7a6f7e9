"""Values stored as JSON in the durable store (run arguments and results, step results), by kombu's JSON.

The rule a step's result must meet: it round-trips (a decode gives back an
equal value of the same types), so a replay hands the body what the first
execution got. kombu's JSON is Celery's own task serializer, so run arguments
stored here decode as the worker decoded them.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any

from kombu.utils import json as kombu_json

from celery_durable.errors import NotJSON

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
    if type(value) in _DECODE_TO_THEMSELVES:
        return encoded
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

#: Exactly these types (not a subclass: an IntEnum comes back a plain int) decode to an equal value of
#: the same type once encoded (a float only finite, and the encode refuses the rest): no decode to check.
_DECODE_TO_THEMSELVES = frozenset({str, int, float, bool, type(None)})


#: What ``kombu_json.dumps(value, allow_nan=False, separators=(",", ":"))`` builds on every call, built once: an
#: encoder keeps no state between calls, and building it was half of encoding a small value (~1.5 µs, six a run).
_ENCODER = kombu_json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def _dumps(value: Any) -> str:
    encoded: str = _ENCODER.encode(value)
    return encoded


#: What ``kombu_json.loads`` builds on every call (``json.loads`` with an ``object_hook``), built once.
_DECODER = json.JSONDecoder(object_hook=kombu_json.object_hook)


def from_json(encoded: str | None) -> Any:
    """A stored value as it was encoded (kombu's typed values decoded back: a datetime is a datetime)."""
    if encoded is None:
        return None
    if type(encoded) is not str or encoded.startswith("\ufeff"):
        return kombu_json.loads(encoded)  # bytes, and the BOM json.loads refuses: as kombu reads them
    return _DECODER.decode(encoded)


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
