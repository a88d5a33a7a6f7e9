"""The operator commands' numeric option types: bounded and finite, so a bad value is refused as click refuses any.

click's ``FloatRange`` lets NaN through (every comparison with NaN is false)
and, without a maximum, infinity and numbers no timer or query can take; a
value that passed ended in a traceback far from the option (``Event.wait``,
``select``, an SQL ``LIMIT``). Refused here, it is one ``Error:`` line naming
the option, exit status 2.
"""

from __future__ import annotations

import math
from typing import Any

import click

from celery_durable.config import LARGEST_LIMIT


class OptionRefused(click.ClickException):
    """A value the command's own checks refused (not click's): one line, and the exit status of bad input."""

    exit_code = 2


def count(low: int = 1) -> click.IntRange:
    """A whole number from ``low`` up to what the store takes as a LIMIT."""
    return click.IntRange(low, LARGEST_LIMIT)


class Seconds(click.FloatRange):
    """Finite seconds between ``low`` and ``high``; NaN is refused by name (FloatRange would take it)."""

    name = "seconds"

    def __init__(self, low: float, high: float) -> None:
        super().__init__(low, high)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if math.isnan(seconds):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return seconds
