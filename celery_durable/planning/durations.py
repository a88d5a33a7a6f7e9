"""Pure: a duration an operator types (``30d``, ``12h``, ``90m``, ``45s``, ``2w``) as seconds."""

from __future__ import annotations

import re

from celery_durable.errors import DurableError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")

#: The longest duration taken: 100 years. Callers subtract it from now, and a
#: datetime cannot go before year 1 (``99999999999999999999d`` was an
#: OverflowError's traceback); no run is that old.
LONGEST_SECONDS = 36500 * 86400


class DurationInvalid(DurableError):
    code = "durable.duration.invalid"


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a positive number and one unit of s, m, h, d, w (``"30d"``, ``"1.5h"``), at most
    ``LONGEST_SECONDS``."""
    match = _DURATION.match(text) if isinstance(text, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise DurationInvalid(f"{text!r} is not a duration: a number above 0 and a unit, s m h d or w "
                              f"(e.g. 30d, 12h, 90m)")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds > LONGEST_SECONDS:
        raise DurationInvalid(f"{text!r} is longer than the longest duration taken, {LONGEST_SECONDS // 86400}d")
    return seconds
