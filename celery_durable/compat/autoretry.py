"""A copy of Celery's autoretry decision: will the task's retry policy send this run again after an error?

Celery decides inside the wrapper ``add_autoretry_behaviour`` puts around a
task's ``run`` (celery 5.x ``app/autoretry.py``): an error of
``autoretry_for`` and not of ``dont_autoretry_for`` is retried while
``request.retries`` is below ``max_retries``, where a ``self.retry(max_retries=n)``
earlier in the same execution overrides the task's own through the
undocumented instance attribute ``Task.override_max_retries`` (set by
``Task.retry``). The durable run settles before the wrapper runs, so it asks
here first. Pinned by tests/compat/test_autoretry.py against Celery's own wrapper.
"""

from __future__ import annotations

from typing import Any


def max_retries(task: Any) -> int | None:
    """The retries the task's policy allows this execution (None: no limit), as Celery's autoretry reads it."""
    value = getattr(task, "override_max_retries", task.max_retries)
    return None if value is None else int(value)


def will_retry(task: Any, exc: BaseException) -> bool:
    """Whether Celery's autoretry (the task's retry policy) will send this run again after ``exc``."""
    retry_for = tuple(getattr(task, "autoretry_for", ()) or ())
    never_for = tuple(getattr(task, "dont_autoretry_for", ()) or ())
    if not retry_for or not isinstance(exc, retry_for) or (never_for and isinstance(exc, never_for)):
        return False
    limit = max_retries(task)
    return limit is None or task.request.retries < limit
