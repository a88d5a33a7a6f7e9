"""Pure step bookkeeping: step keys by call order and the checks of step names and run ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from celery_durable.errors import RunIdInvalid, StepNameInvalid

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
