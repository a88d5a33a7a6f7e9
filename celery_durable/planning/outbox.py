"""Pure outbox rules: which publish options a row keeps, how a batch settles, how long the relay waits."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

#: apply_async options a row may carry. Others (a producer, a connection, link callbacks) either
#: cannot outlive the caller's process or would make a republish start new work.
OPTION_KEYS = frozenset({
    "queue", "routing_key", "exchange", "priority", "headers", "countdown", "eta", "expires",
    "time_limit", "soft_time_limit", "shadow", "serializer", "argsrepr", "kwargsrepr",
})

#: Callback options the outbox refuses, on a task or any step of a chain: each run would start
#: its callbacks again under new ids, so a republished message would too.
CALLBACK_OPTIONS = ("link", "link_error")

#: The backoff between publish attempts of one row (and between failing relay passes).
BACKOFF_BASE = 0.5
BACKOFF_CAP = 60.0
#: Each backoff is spread by up to this fraction either way (never past the cap), so the relays of
#: a fleet (one in every worker) that lost the broker together do not retry in lockstep.
BACKOFF_JITTER = 0.2
#: While it backs off, the relay checks the store and the broker this often (or at the end of a
#: shorter backoff): a check that finds them back ends the backoff at once.
PROBE_EVERY = 1.0

#: A row that failed this many publishes is flagged: logged at error level and counted, never dropped.
FLAG_AFTER = 10


class OptionInvalid(ValueError):
    """An option a row cannot keep; the message names it."""


def serialize_options(options: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """The JSON form of apply_async options, with relative times made absolute at ``now``.

    ``countdown`` and a numeric ``expires`` count from the enqueue (the caller's
    clock, the moment it decided), not from whenever the relay publishes.
    """
    unknown = sorted(set(options) - OPTION_KEYS)
    if unknown:
        raise OptionInvalid(f"option {unknown[0]!r} cannot be stored in the outbox "
                            f"(allowed: {', '.join(sorted(OPTION_KEYS))})")
    out: dict[str, Any] = {}
    for key, value in options.items():
        if value is None:
            continue
        if key == "countdown":
            if options.get("eta") is not None:
                raise OptionInvalid("give countdown or eta, not both")
            out["eta"] = (now + timedelta(seconds=_seconds("countdown", value))).isoformat()
        elif key == "eta":
            out["eta"] = _aware("eta", value).isoformat()
        elif key == "expires":
            if isinstance(value, datetime):
                out["expires"] = _aware("expires", value).isoformat()
            else:
                out["expires"] = (now + timedelta(seconds=_seconds("expires", value))).isoformat()
        elif key == "priority":
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
                raise OptionInvalid(f"priority must be a whole number 0..255, got {value!r}")
            out[key] = value
        elif key in ("argsrepr", "kwargsrepr"):
            if not isinstance(value, str):
                raise OptionInvalid(f"{key} must be a string, got {value!r}")
            out[key] = value
        elif key in ("queue", "routing_key", "exchange", "shadow", "serializer"):
            # A kombu Queue or Exchange object stands for its name.
            name = getattr(value, "name", value)
            if not isinstance(name, str) or not name:
                raise OptionInvalid(f"{key} must be a name, got {value!r}")
            out[key] = name
        elif key in ("time_limit", "soft_time_limit"):
            out[key] = _seconds(key, value)
        elif key == "headers":
            if not isinstance(value, Mapping):
                raise OptionInvalid(f"headers must be a mapping, got {value!r}")
            out[key] = dict(value)
    try:
        json.dumps(out, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise OptionInvalid(f"options must be JSON (headers included): {err}") from None
    return out


def without_callbacks(where: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` less its (empty) callbacks; a callback set raises OptionInvalid naming ``where``."""
    for key in CALLBACK_OPTIONS:
        if options.get(key):
            raise OptionInvalid(f"{where}: {key} callbacks cannot be stored in the outbox "
                                f"(a republish would start them again under new ids)")
    return {key: value for key, value in options.items() if key not in CALLBACK_OPTIONS}


def chain_step_options(task: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON form of the options of a chain step after the first, as its message embed carries them.

    The worker applies the step when its predecessor ends (``Signature.apply_async``),
    so its options stay as Celery keeps them: a ``countdown`` counts from then, not
    from the enqueue. Only datetimes (``eta``, ``expires``) are written out, as ISO
    8601, which Celery's send path reads back; ``reply_to`` (the enqueuing thread's
    queue) is dropped, as for the first task.
    """
    out: dict[str, Any] = {}
    for key, value in without_callbacks(f"chain step {task}", options).items():
        if key == "reply_to" or value is None:
            continue
        if key in ("eta", "expires") and isinstance(value, datetime):
            value = _aware(key, value).isoformat()
        out[key] = value
    try:
        json.dumps(out, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise OptionInvalid(f"the options of chain step {task} must be JSON: {err}") from None
    return out


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise OptionInvalid(f"{key} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def _aware(key: str, value: Any) -> datetime:
    if not isinstance(value, datetime):
        raise OptionInvalid(f"{key} must be a datetime, got {value!r}")
    # A naive time would be read in whichever time zone the worker runs with.
    if value.tzinfo is None or value.utcoffset() is None:
        raise OptionInvalid(f"{key} must be timezone-aware, got {value!r}")
    return value


def backoff_delay(attempts: int, *, base: float = BACKOFF_BASE, cap: float = BACKOFF_CAP,
                  jitter: float = 0.0, draw: float = 0.5) -> float:
    """Seconds to wait after ``attempts`` consecutive failed publishes: 0, then 0.5, 1, 2, ... up to cap.

    ``draw`` is a number in [0, 1] the caller picked at random (planning stays pure): it
    moves the delay by up to ``jitter`` of itself either way, 0.5 not at all. A jittered
    delay never exceeds ``cap``.
    """
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be a fraction in [0, 1), got {jitter!r}")
    if not 0.0 <= draw <= 1.0:
        raise ValueError(f"draw must be in [0, 1], got {draw!r}")
    if attempts <= 0:
        return 0.0
    # min before the power would overflow for a row failing for weeks.
    delay = min(cap, base * 2.0 ** min(attempts - 1, 64))
    return min(cap, delay * (1.0 + jitter * (2.0 * draw - 1.0)))


def probe_after(backoff_left: float, *, probe_every: float = PROBE_EVERY) -> float:
    """Seconds until a backing-off relay next checks its store and broker: the probe interval,
    or what is left of the backoff if less (the pass at its end is a check of its own)."""
    return max(0.0, min(backoff_left, probe_every))


@dataclass(frozen=True)
class BatchOutcome:
    """How one claimed batch settles once its publishes ran (in id order, stopping at the first error)."""

    published: tuple[int, ...]
    #: The row whose publish raised, its attempts after this one, and when to try it again.
    failed: int | None = None
    failed_attempts: int = 0
    retry_in: float = 0.0
    #: True the first time a row reaches FLAG_AFTER failed attempts.
    flag: bool = False
    #: Rows after the failure: not tried, left exactly as they were.
    untried: tuple[int, ...] = ()


def settle_batch(ids: Sequence[int], published: int, prior_attempts: int | None,
                 *, flag_after: int = FLAG_AFTER, jitter: float = 0.0, draw: float = 0.5) -> BatchOutcome:
    """``published`` rows of ``ids`` went out; ``prior_attempts`` is the next row's count if it raised.

    ``jitter`` and ``draw`` spread the failed row's retry as in ``backoff_delay``.
    """
    if not 0 <= published <= len(ids):
        raise ValueError(f"published={published} is outside a batch of {len(ids)}")
    done = tuple(ids[:published])
    if prior_attempts is None or published == len(ids):
        return BatchOutcome(published=done)
    attempts = prior_attempts + 1
    return BatchOutcome(
        published=done,
        failed=ids[published],
        failed_attempts=attempts,
        retry_in=backoff_delay(attempts, jitter=jitter, draw=draw),
        flag=attempts == flag_after,
        untried=tuple(ids[published + 1:]),
    )


def next_wait(*, claimed: int, batch_size: int, failures: int, poll_interval: float,
              jitter: float = 0.0, draw: float = 0.5) -> float:
    """Seconds the relay waits before its next pass (a wake-up may cut it short, except after a failure).

    A full batch means more rows are likely waiting: go again at once. A failing
    pass (broker or database down) backs off by consecutive failures, spread by
    ``jitter`` as in ``backoff_delay``; probes (``probe_after``) may end it early.
    """
    if failures > 0:
        return backoff_delay(failures, jitter=jitter, draw=draw)
    if claimed >= batch_size:
        return 0.0
    return poll_interval
