"""Pure: the fleet limits a task declares (``durable_concurrency``, ``durable_key``…), read and checked.

A task declares them as options of ``@app.task`` / ``@app.durable_task``,
which Celery keeps as attributes of the task class. They are read once, when
a worker boots; a bad value refuses the boot naming the task and the option.
A limit is enforced per *scope*: the task's own name for ``durable_concurrency``,
the task and a key for ``durable_key_limit``, and the task for ``durable_rate_limit``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from celery_durable.errors import DurableError

#: The task options, as a user writes them.
CONCURRENCY = "durable_concurrency"
KEY = "durable_key"
KEY_LIMIT = "durable_key_limit"
WHEN_BUSY = "durable_when_busy"
RATE_LIMIT = "durable_rate_limit"
RATE_BURST = "durable_rate_burst"
OPTIONS = (CONCURRENCY, KEY, KEY_LIMIT, WHEN_BUSY, RATE_LIMIT, RATE_BURST)
#: Every ``durable_*`` option a task may declare: a task attribute of that prefix outside it is a typo.
#: (``durable_catch_up`` is a beat entry's option, read off ``beat_schedule``, never off a task.)
TASK_OPTIONS = frozenset(OPTIONS)
_OPTION_PREFIX = "durable_"

#: ``durable_when_busy``: the message waits its turn in the store, or is acked without running.
WAIT, DROP = "wait", "drop"
WHEN_BUSY_CHOICES = (WAIT, DROP)

#: Scope kinds, as stored.
TASK_SCOPE, KEY_SCOPE = "task", "key"

#: Longest key a key function may return (the store's column holds 200 characters).
MAX_KEY_LENGTH = 200

#: Largest count a limit option may hold: the store's SQL takes limits as PostgreSQL ``integer``,
#: and a larger one (``sys.maxsize`` as "unlimited") boots and then fails every claim of the task.
MAX_COUNT = 2**31 - 1

_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE = re.compile(r"^\s*(\d+)\s*/\s*([smhd])\s*$")


class LimitInvalid(DurableError):
    """A task's limit option holds a value no worker can enforce; the message names the task and option."""

    code = "durable.limit.invalid"


class KeyFunctionFailed(DurableError):
    """A task's ``durable_key`` raised or returned something that is not a key, for one message (or
    the message's own ``durable_when_busy`` header is not a choice): that run fails, named."""

    code = "durable.limit.key_failed"


@dataclass(frozen=True)
class Rate:
    """``count`` runs per ``period`` seconds, fleet-wide, spread evenly; ``burst`` may start back to back."""

    count: int
    period: float
    burst: int = 1

    @property
    def interval(self) -> float:
        """Seconds between two starts at the steady rate (GCRA's emission interval)."""
        return self.period / self.count


@dataclass(frozen=True)
class Scope:
    """One limit a run must fit under: ``limit`` runs at once per (task, kind, key)."""

    task: str
    kind: str
    key: str
    limit: int


@dataclass(frozen=True)
class TaskLimits:
    """What one task declared; ``None`` fields are limits it does not have."""

    task: str
    concurrency: int | None = None
    key: Callable[..., Any] | None = None
    key_limit: int = 1
    when_busy: str = WAIT
    rate: Rate | None = None

    def scopes(self, args: Any, kwargs: Any, given_key: Any = None) -> tuple[Scope, ...]:
        """The scopes a run with these arguments needs a lease in (key function called here).

        ``given_key`` is a key the message names itself (its ``durable_key``
        header, from ``apply_async(headers=...)``): it replaces the function's.
        """
        scopes = []
        if self.concurrency is not None:
            scopes.append(Scope(self.task, TASK_SCOPE, "", self.concurrency))
        if self.key is not None:
            scopes.append(Scope(self.task, KEY_SCOPE, self._key_of(args, kwargs, given_key), self.key_limit))
        return tuple(scopes)

    def when_busy_of(self, given: Any = None) -> str:
        """What a message does when a scope is busy: its own ``durable_when_busy`` header if it names
        one (``apply_async(headers=...)``), else the task's; a bad one fails that run, named."""
        if given is None:
            return self.when_busy
        if given not in WHEN_BUSY_CHOICES:
            raise KeyFunctionFailed(f"task {self.task!r}: header {WHEN_BUSY} must be one of {WHEN_BUSY_CHOICES}, "
                                    f"got {given!r}")
        return str(given)

    def _key_of(self, args: Any, kwargs: Any, given_key: Any) -> str:
        assert self.key is not None
        if given_key is not None:
            key = given_key
        else:
            try:
                key = self.key(*(args or ()), **(kwargs or {}))
            except Exception as err:  # any error of the user's function fails the run, named
                raise KeyFunctionFailed(f"task {self.task!r}: {KEY} raised {err!r}") from err
        if not isinstance(key, str) or not key:
            raise KeyFunctionFailed(f"task {self.task!r}: {KEY} must return a non-empty string, got {key!r}")
        if len(key) > MAX_KEY_LENGTH:
            raise KeyFunctionFailed(f"task {self.task!r}: {KEY} returned a key of {len(key)} characters; "
                                    f"at most {MAX_KEY_LENGTH}")
        unstorable = _unstorable(key)
        if unstorable:
            # Caught here, before the claim pass's store transaction: there it would fail the whole
            # pass, every limited message of it going back to the broker, again at every pass.
            raise KeyFunctionFailed(f"task {self.task!r}: {KEY} returned {key!r}, which {unstorable}")
        return key


def _unstorable(key: str) -> str | None:
    """Why the store cannot hold ``key`` as text, or None: PostgreSQL text holds no NUL and only UTF-8."""
    if "\x00" in key:
        return "contains a NUL character (the store's text cannot hold one)"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"is not valid Unicode text at index {err.start} (a lone surrogate; the store holds UTF-8 only)"
    return None


def parse_rate(task: str, value: Any, burst: Any = None) -> Rate:
    """``"100/m"`` (also ``/s``, ``/h``, ``/d``) as a :class:`Rate`; anything else names the task and option."""
    match = _RATE.match(value) if isinstance(value, str) else None
    if match is None or int(match.group(1)) < 1:
        raise LimitInvalid(f"task {task!r}: {RATE_LIMIT} must be '<count>/<s|m|h|d>' with a count >= 1 "
                           f"(e.g. '100/m'), got {value!r}")
    count = int(match.group(1))
    if count > MAX_COUNT:
        raise LimitInvalid(f"task {task!r}: {RATE_LIMIT} count must be at most {MAX_COUNT}, got {value!r} "
                           f"(leave {RATE_LIMIT} out for no rate limit)")
    return Rate(count, _PERIODS[match.group(2)], _whole(task, RATE_BURST, 1 if burst is None else burst))


def declared(task_name: str, options: Mapping[str, Any]) -> TaskLimits | None:
    """The limits in ``options`` (a task's attributes by option name); None if it declares none."""
    given = {name: options[name] for name in OPTIONS if options.get(name) is not None}
    if not given:
        return None
    if KEY_LIMIT in given and KEY not in given:
        raise LimitInvalid(f"task {task_name!r}: {KEY_LIMIT} needs {KEY} (the function naming each run's key)")
    if WHEN_BUSY in given and KEY not in given and CONCURRENCY not in given:
        raise LimitInvalid(f"task {task_name!r}: {WHEN_BUSY} needs {CONCURRENCY} or {KEY} (a limit to be busy)")
    if RATE_BURST in given and RATE_LIMIT not in given:
        raise LimitInvalid(f"task {task_name!r}: {RATE_BURST} needs {RATE_LIMIT}")
    key = given.get(KEY)
    if key is not None and not callable(key):
        raise LimitInvalid(f"task {task_name!r}: {KEY} must be a function of the task's arguments "
                           f"returning the key, got {key!r}")
    when_busy = given.get(WHEN_BUSY, WAIT)
    if when_busy not in WHEN_BUSY_CHOICES:
        raise LimitInvalid(f"task {task_name!r}: {WHEN_BUSY} must be one of {WHEN_BUSY_CHOICES}, got {when_busy!r}")
    return TaskLimits(
        task=task_name,
        concurrency=_whole(task_name, CONCURRENCY, given[CONCURRENCY]) if CONCURRENCY in given else None,
        key=key,
        key_limit=_whole(task_name, KEY_LIMIT, given.get(KEY_LIMIT, 1)),
        when_busy=when_busy,
        rate=parse_rate(task_name, given[RATE_LIMIT], given.get(RATE_BURST)) if RATE_LIMIT in given else None,
    )


def unknown_option(task_name: str, attributes: Iterable[str]) -> LimitInvalid | None:
    """The refusal for the first ``durable_*`` attribute that is no task option (a typo), else None.

    A misspelt option (``durable_concurency=2``) would otherwise boot with no
    limit and no word, as Celery keeps any keyword of ``@app.task`` as an attribute.
    """
    for name in sorted(attributes):
        if name.startswith(_OPTION_PREFIX) and name not in TASK_OPTIONS:
            # Matched without the prefix every option shares, which would make any name look near.
            near = difflib.get_close_matches(name[len(_OPTION_PREFIX):],
                                             [option[len(_OPTION_PREFIX):] for option in OPTIONS], n=1)
            hint = (f"; did you mean {_OPTION_PREFIX}{near[0]}?" if near
                    else f"; the options are {', '.join(OPTIONS)}")
            return LimitInvalid(f"task {task_name!r}: {name} is not a celery_durable task option{hint}")
    return None


def of_task(task: Any) -> TaskLimits | None:
    """The limits a registered Celery task declares; an unknown ``durable_*`` option is refused."""
    # Read off the class: Celery keeps the options as class attributes, and a
    # function read through the instance would come back bound to the task.
    refusal = unknown_option(task.name, dir(type(task)))
    if refusal is not None:
        raise refusal
    return declared(task.name, {name: getattr(type(task), name, None) for name in OPTIONS})


def of_app(app: Any) -> dict[str, TaskLimits]:
    """Every registered task of ``app`` that declares a limit, by name; the first bad one raises."""
    found = {}
    for name in sorted(app.tasks.keys()):
        limits = of_task(app.tasks[name])
        if limits is not None:
            found[name] = limits
    return found


def first_option(limits: TaskLimits) -> str:
    """The option a refusal names for a task with these limits."""
    if limits.concurrency is not None:
        return CONCURRENCY
    if limits.key is not None:
        return KEY
    return RATE_LIMIT


def _whole(task: str, option: str, value: Any) -> int:
    # bool is an int to Python; a float (2.5, NaN, even 3.0) is refused rather than rounded.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LimitInvalid(f"task {task!r}: {option} must be a whole number >= 1, got {value!r}")
    if value > MAX_COUNT:
        raise LimitInvalid(f"task {task!r}: {option} must be at most {MAX_COUNT}, got {value!r} "
                           f"(leave {option} out for no limit)")
    return value
